//go:build !race

package racepass

const raceBuilt = false
