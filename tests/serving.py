"""Start a real `moefit serve` process for a test and stop it afterwards."""

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, pack, card_path, state_dir, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moefit", "serve", str(pack), "--port", str(self.port), "--device",
               f"sim:{card_path}", "--ctx", "512", "--vram-reserve-mib", "8", "--low-headroom-mib", "0",
               "--min-free-vram-mib", "8", "--grow-margin-mib", "1", "--min-expert-slots", "0", "--served-model-name", "tiny",
               "--state-dir", str(state_dir), "--settle-s", "0", "--keepalive-s", "0.2", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.proc.stderr.read()
            time.sleep(0.2)
        raise TimeoutError("moefit serve did not become ready")

    def stop(self) -> str:
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        return err


