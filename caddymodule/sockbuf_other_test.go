//go:build !unix

package caddymodule_test

import "syscall"

// smallReceiveBuffer leaves the socket as it is where the tests do not tune it.
func smallReceiveBuffer(_, _ string, _ syscall.RawConn) error { return nil }
