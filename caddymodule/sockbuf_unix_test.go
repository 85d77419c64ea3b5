//go:build unix

package caddymodule_test

import "syscall"

// smallReceiveBuffer gives a client socket a 64 KiB receive buffer (net.Dialer.Control): Linux grows a loopback
// socket's buffer to tens of megabytes otherwise, and a response the client stops reading would fit in it whole.
func smallReceiveBuffer(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 64<<10)
	}); err != nil {
		return err
	}
	return serr
}
