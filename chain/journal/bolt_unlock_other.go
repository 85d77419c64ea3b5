//go:build !unix

package journal

import "os"

// releaseLock does nothing where bbolt's lock is released by closing the file.
func releaseLock(*os.File) {}
