//go:build race

package racepass

const raceBuilt = true
