package e2e

import "syscall"

// dieWithParent makes the kernel kill a child when the test binary dies, so that a test killed by its
// timeout leaves no Caddy holding ports behind.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
