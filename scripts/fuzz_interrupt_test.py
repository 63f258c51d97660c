"""scripts/fuzz.sh stops at Ctrl-C. libFuzzer catches SIGINT and exits 72
("run interrupted"), so bash, seeing its child exit normally, went on with the
next target: a Ctrl-C stopped one target, not the run. The fuzzers here are
fakes made by a fake clang++-14 (bazel is a fake too); they catch SIGINT as
libFuzzer does."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz.sh")
LIBFUZZER = "/usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a"

FAKE_CLANG = r"""#!/bin/sh
# -c SRC -o OBJ: an empty object; -o BIN (a link): a fake fuzzer.
out=""; compile=0
while [ $# -gt 0 ]; do
  case "$1" in -o) out=$2; shift ;; -c) compile=1 ;; esac
  shift
done
if [ "$compile" = 1 ]; then : >"$out"; exit 0; fi
cat >"$out" <<'EOF'
#!/bin/sh
basename "$0" >>"$FAKE_DIR/ran"
trap 'echo "==1== libFuzzer: run interrupted; exiting"; exit 72' INT
echo $$ >"$FAKE_DIR/fuzzing"
sleep 20 &
wait
echo "Done 20000 runs in 20 second(s)"
EOF
chmod +x "$out"
"""


@unittest.skipUnless(os.path.exists(LIBFUZZER) and shutil.which("clang++-14"),
                     "fuzz.sh needs clang-14 and libfuzzer-14-dev (scripts/setup.sh)")
class FuzzInterruptTest(unittest.TestCase):
    def test_ctrl_c_stops_the_run(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "repo", "scripts"))
            shutil.copy(SCRIPT, os.path.join(d, "repo", "scripts", "fuzz.sh"))
            path = os.path.join(d, "path")
            os.mkdir(path)
            for name, text in (("clang++-14", FAKE_CLANG), ("bazel", "#!/bin/sh\nexit 0\n")):
                with open(os.path.join(path, name), "w") as f:
                    f.write(text)
                os.chmod(os.path.join(path, name), 0o755)
            env = dict(os.environ, PATH=path + os.pathsep + os.environ["PATH"], FAKE_DIR=d)
            # Its own process group, as a terminal's foreground job: SIGINT
            # to the group is a Ctrl-C.
            p = subprocess.Popen(["bash", os.path.join(d, "repo", "scripts", "fuzz.sh"),
                                  "cluster", "safetensors"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, start_new_session=True)
            try:
                fuzzing = os.path.join(d, "fuzzing")
                for _ in range(600):
                    if os.path.exists(fuzzing) or p.poll() is not None:
                        break
                    time.sleep(0.1)
                self.assertTrue(os.path.exists(fuzzing), "the first fuzzer never started")
                os.killpg(p.pid, signal.SIGINT)
                out, _ = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            self.assertEqual(p.returncode, 130, out)
            self.assertIn("fuzz: interrupted", out)
            with open(os.path.join(d, "ran")) as f:
                self.assertEqual(f.read().split(), ["cluster"], out)


if __name__ == "__main__":
    unittest.main()
