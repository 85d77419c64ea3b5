package racepass

import (
	"os"
	"os/exec"
	"runtime/debug"
	"strings"
	"testing"
)

// builtWithRace reads from the binary's build settings, not from raceBuilt, whether it was built with -race.
func builtWithRace(t *testing.T) bool {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		t.Fatal("the test binary has no build information")
	}
	for _, s := range info.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// The skip happens only in a race-built binary with the variable set: a plain binary with X402_RACE_PASS=1 (a
// developer's shell that kept it, the plain pass of a CI that exported it too early) runs the test.
func TestOnceSkipsOnlyUnderRaceWithTheVariableSet(t *testing.T) {
	if os.Getenv("RACEPASS_CHILD") == "1" {
		Once(t, "the child's drill")
		t.Log("RAN")
		return
	}
	race := builtWithRace(t)
	if race != raceBuilt {
		t.Fatalf("built with -race %v, but raceBuilt is %v", race, raceBuilt)
	}
	for _, c := range []struct {
		race, env bool
		skipped   bool
	}{{false, false, false}, {false, true, false}, {true, false, false}, {true, true, true}} {
		if c.race != race {
			continue // the other half runs in the other pass
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestOnceSkipsOnlyUnderRaceWithTheVariableSet$", "-test.v")
		cmd.Env = append(os.Environ(), "RACEPASS_CHILD=1", Env+"=")
		if c.env {
			cmd.Env = append(cmd.Env, Env+"=1")
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("race %v, %s set %v: %v\n%s", c.race, Env, c.env, err, out)
		}
		ran, skipped := strings.Contains(string(out), "RAN"), strings.Contains(string(out), "--- SKIP")
		if ran == c.skipped || skipped != c.skipped {
			t.Errorf("race %v, %s set %v: ran %v, skipped %v; want skipped %v\n%s", c.race, Env, c.env, ran, skipped, c.skipped, out)
		}
	}
}
