package e2e

import "syscall"

// dieWithParent makes the kernel kill a child when the test binary dies, so that a test killed by its
// timeout leaves no Caddy holding ports behind.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// capReceiveBuffer caps a socket's receive buffer at n bytes, which also stops the kernel growing it: a client
// that stops reading then holds back the server's writes after at most that much (and the server's send buffer).
func capReceiveBuffer(fd uintptr, n int) error {
	return syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, n)
}
