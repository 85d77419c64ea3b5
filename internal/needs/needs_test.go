package needs

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// A missing program skips the test with a line naming what to install, and fails it under CI.
func TestAMissingProgramSkipsOutsideCIAndFailsUnderIt(t *testing.T) {
	if os.Getenv("NEEDS_HELPER") == "1" {
		Command(t, "no-such-program-x402", "apt-get install no-such-package")
		t.Fatal("Command returned for a program that is not installed")
	}
	for _, tc := range []struct {
		ci       string
		wantFail bool
		want     string
	}{
		{"", false, "--- SKIP"},
		{"false", false, "--- SKIP"},
		{"true", true, "--- FAIL"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestAMissingProgramSkipsOutsideCIAndFailsUnderIt$", "-test.v")
		cmd.Env = append(os.Environ(), "NEEDS_HELPER=1", "CI="+tc.ci)
		out, err := cmd.CombinedOutput()
		if (err != nil) != tc.wantFail {
			t.Errorf("CI=%q: exit error %v, want failure %v:\n%s", tc.ci, err, tc.wantFail, out)
		}
		if !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), "needs no-such-program-x402: apt-get install no-such-package") {
			t.Errorf("CI=%q: output lacks %q and the line naming what to install:\n%s", tc.ci, tc.want, out)
		}
	}
}

func TestCommandFindsAnInstalledProgram(t *testing.T) {
	if p := Command(t, "go", "install Go"); p == "" {
		t.Fatal("no path for go")
	}
}
