//go:build !linux

package e2e

import "syscall"

// dieWithParent has no portable equivalent outside Linux: children are stopped by the tests' cleanups only.
func dieWithParent() *syscall.SysProcAttr { return nil }
