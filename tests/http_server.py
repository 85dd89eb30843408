"""The server in tests: a loaded model's `Started` (as ktlong.session.startup.start makes it),
and uvicorn serving an app on a free local port, in a thread of the test process; or the server's
command in a process of its own, on the free port it takes."""

import http.client
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request

import uvicorn

from ktlong.config import default_config
from ktlong.session.startup import Started


def started(lm, model, **options) -> Started:
    """What start() returns, for a model already loaded (tests share one)."""
    config = default_config(model=str(model), **options)
    max_seq_len = config.max_seq_len or lm.config.context_length
    session = None
    if config.mode == "long_context":
        from ktlong.session.long_context import LongContextSession
        from ktlong.session.plan import plan_session

        plan = plan_session(config, lm.config, lm.weight_bytes, max_seq_len, lm.model.device,
                            lm.model.dtype)
        session = LongContextSession.from_plan(lm.model, plan)
    return Started(lm, config, max_seq_len, session)


class RunningServer:
    """uvicorn on a free local port, in a thread of this process."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key="none", timeout=120, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kw)

    def raw(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data

    def health(self) -> dict:
        status, data = self.raw("GET", "/health")
        assert status == 200
        return json.loads(data)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


class LaunchedServer:
    """The server's command (`python -m ktlong.server ...`, or under torchrun) with `--port 0`:
    it binds a free port before it loads and says which, so no other process can take the port
    between a pick and a bind. Its stdout and stderr together are read into `log()`."""

    def __init__(self, argv: list[str], timeout: float = 300, **popen):
        self.process = subprocess.Popen([*argv, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, **popen)
        self.lines: list[str] = []
        self.port = None
        said = threading.Event()

        def read():
            for line in self.process.stdout:
                self.lines.append(line)
                if self.port is None and (m := re.search(r"\[serving .* at http://[^:]+:(\d+)/v1", line)):
                    self.port = int(m[1])
                    said.set()
            said.set()  # it ended without saying

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.time() + timeout
        said.wait(timeout)
        while True:  # uvicorn listens a moment after the line
            assert self.port is not None and self.process.poll() is None, self.log()[-3000:]
            assert time.time() < deadline, "the server did not answer /health"
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """What it printed so far (all of it once it has exited)."""
        if self.process.poll() is not None:
            self.reader.join(30)
        return "".join(self.lines)

    def wait(self, timeout: float = 120) -> int:
        code = self.process.wait(timeout)
        self.reader.join(timeout)
        return code
