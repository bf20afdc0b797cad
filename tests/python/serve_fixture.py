"""A real `dsv4 serve` process for the server tests: the built-in tiny model (random
weights) on the CPU, any free port, stopped with SIGTERM at the end (exit status 0
required: under the ASan build that includes LeakSanitizer's verdict)."""
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

CLI = os.environ.get("DSV4_CLI", "dsv4")
BINARY_DIR = os.environ.get("DSV4_BINARY_DIR", ".")
MODEL_NAME = "dsv4-builtin-tiny-v2"  # the built-in model file's stem: synth.h kSynthVersion


class Server:
    def __init__(self, *args, env=None):
        self.tmp = tempfile.TemporaryDirectory()
        port_file = os.path.join(self.tmp.name, "port")
        e = dict(os.environ)
        e["DSV4_CACHE_DIR"] = os.path.join(BINARY_DIR, "test-cache-text")
        e.update(env or {})
        self.log_path = os.path.join(self.tmp.name, "serve.log")
        self.log = open(self.log_path, "w")
        cmd = [CLI, "serve", "--port", "0", "--port-file", port_file, "-t", "2", "--ctx", "1024", *args]
        if "--backend" not in args:  # the CPU's reference numerics, also where a GPU is present
            cmd += ["--backend", "cpu"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 300
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("dsv4 serve did not start:\n" + self.output())
            time.sleep(0.05)
        with open(port_file) as f:
            self.port = int(f.read())
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def request(self, method, path, body=None, headers=None, raw=None):
        """(status, headers, parsed JSON or text) of one plain HTTP request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status, hdrs, text = r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as err:
            status, hdrs, text = err.code, dict(err.headers), err.read().decode()
        try:
            return status, hdrs, json.loads(text)
        except ValueError:
            return status, hdrs, text

    def metrics(self, headers=None):
        status, _, text = self.request("GET", "/metrics", headers=headers)
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self):
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def close(self, test):
        rc = self.stop()
        with open(self.log_path) as f:
            out = f.read()
        self.tmp.cleanup()
        test.assertEqual(rc, 0, "dsv4 serve exited with %s:\n%s" % (rc, out[-4000:]))
