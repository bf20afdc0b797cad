"""`dsv4 synth-checkpoint` + `dsv4 convert` from the outside: the progress bar shows on a
terminal and stays quiet otherwise, a killed conversion leaves no file that looks like a
valid GGUF, and `--dry-run` / `--split-max-size` behave."""
import os
import pty
import select
import signal
import subprocess
import sys
import tempfile
import time
import unittest

CLI = os.environ.get("DSV4_CLI", "dsv4")
SHARED = os.environ.get("DSV4_SHARED_DIR", os.path.join(os.path.dirname(__file__), "../../../shared"))
SOURCE = os.environ.get("DSV4_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "../.."))
FIXTURE_CONFIG = os.path.join(SHARED, "fixtures", "tiny-v4", "checkpoint")


class ConvertCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        # The fixture's geometry with fresh random weights, in three shards.
        cls.ckpt = os.path.join(cls.tmp.name, "ckpt")
        r = subprocess.run([CLI, "synth-checkpoint", "--config", FIXTURE_CONFIG, "--seed", "3", "-o", cls.ckpt,
                            "--shard-gb", "0.004"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "3 shards" in r.stdout, r.stdout

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_progress_only_on_a_terminal(self):
        out = os.path.join(self.tmp.name, "quiet.gguf")
        r = subprocess.run([CLI, "convert", self.ckpt, "-o", out, "--recipe", "q8"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")
        self.assertIn("recipe q8", r.stdout)

        out = os.path.join(self.tmp.name, "tty.gguf")
        master, slave = pty.openpty()
        p = subprocess.Popen([CLI, "convert", self.ckpt, "-o", out, "--recipe", "q8"], stdout=subprocess.DEVNULL,
                             stderr=slave)
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            if not ready:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        self.assertEqual(p.wait(), 0)
        os.close(master)
        text = seen.decode(errors="replace")
        for fragment in ("tensors", "GB", "MB/s", "ETA", "100%"):
            self.assertIn(fragment, text)

    def test_killed_conversion_leaves_no_valid_output(self):
        big = os.path.join(self.tmp.name, "big")
        r = subprocess.run([CLI, "synth-checkpoint", "--preset", "tiny", "--seed", "4", "-o", big],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp.name, "killed.gguf")
        p = subprocess.Popen([CLI, "convert", big, "-o", out, "--recipe", "q2k", "--threads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while not os.path.exists(out + ".tmp") and time.time() < deadline and p.poll() is None:
            time.sleep(0.01)
        time.sleep(0.2)
        self.assertIsNone(p.poll(), "the conversion finished before it could be killed")
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertFalse(os.path.exists(out))
        if os.path.exists(out + ".tmp"):
            r = subprocess.run([CLI, "info", out + ".tmp"], capture_output=True, text=True)
            self.assertNotEqual(r.returncode, 0, "a partial output reads as a valid GGUF")

    def test_interrupted_conversion_cleans_up(self):
        big = os.path.join(self.tmp.name, "big2")
        r = subprocess.run([CLI, "synth-checkpoint", "--preset", "tiny", "--seed", "5", "-o", big],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp.name, "interrupted.gguf")
        p = subprocess.Popen([CLI, "convert", big, "-o", out, "--recipe", "q2k", "--threads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while not os.path.exists(out + ".tmp") and time.time() < deadline and p.poll() is None:
            time.sleep(0.01)
        self.assertIsNone(p.poll(), "the conversion finished before it could be interrupted")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 130, err)
        self.assertIn("interrupted", err)
        self.assertEqual([f for f in os.listdir(self.tmp.name) if f.startswith("interrupted.gguf")], [])

    def test_dry_run_needs_only_config(self):
        flash = os.path.join(SOURCE, "tests", "data", "deepseek-v4-flash")
        r = subprocess.run([CLI, "convert", flash, "--dry-run", "--recipe", "q2k"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1359 tensors", r.stdout)
        self.assertIn("fallbacks: none", r.stdout)

    def test_pro_dry_run(self):
        pro = os.path.join(SOURCE, "tests", "data", "deepseek-v4-pro")
        r = subprocess.run([CLI, "convert", pro, "--dry-run", "--recipe", "mxfp4"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1925 tensors", r.stdout)
        self.assertIn("186 tensors", r.stdout)  # 62 blocks x 3 expert stacks in MXFP4
        self.assertIn("fallbacks: none", r.stdout)

    def test_split_output(self):
        out = os.path.join(self.tmp.name, "split.gguf")
        r = subprocess.run([CLI, "convert", self.ckpt, "-o", out, "--recipe", "bf16", "--split-max-size", "4M"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        parts = sorted(f for f in os.listdir(self.tmp.name) if f.startswith("split-"))
        self.assertGreater(len(parts), 1)
        r = subprocess.run([CLI, "info", os.path.join(self.tmp.name, parts[0])], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("catalog check: ok", r.stdout)

    def test_usage_errors(self):
        for args, fragment in ((["--recipe", "q3"], "unknown recipe"),
                               (["--type", "experts=q9_9"], "cannot write type"),
                               (["--type", "small=q8_0"], "must be f32, f16 or bf16"),
                               (["--type", "heads=q8_0"], "unknown tensor role"),
                               (["--split-max-size", "lots"], "--split-max-size")):
            r = subprocess.run([CLI, "convert", self.ckpt, "-o", os.path.join(self.tmp.name, "x.gguf"), *args],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, args)
            self.assertIn(fragment, r.stderr)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
