package contracts

// The compiler and OpenZeppelin come pinned from package-lock.json; nothing is downloaded
// at build time, only at generate time.
//go:generate npm ci --no-audit --no-fund
//go:generate node build.js
