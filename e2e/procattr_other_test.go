//go:build !linux

package e2e

import "syscall"

// dieWithParent has no portable equivalent outside Linux: children are stopped by the tests' cleanups only.
func dieWithParent() *syscall.SysProcAttr { return nil }

// capReceiveBuffer leaves the socket as it is outside Linux: a cut-short response is then cut only as far as the
// kernel's buffers allow.
func capReceiveBuffer(uintptr, int) error { return nil }
