//go:build unix

package journal

import (
	"os"
	"syscall"
)

// releaseLock drops bbolt's flock on f. Closing f alone would not: the memory map bbolt made of the file
// holds the open file, and with it the lock, for as long as it exists.
func releaseLock(f *os.File) { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN) }
