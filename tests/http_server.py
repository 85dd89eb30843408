"""The server in tests: a loaded model's `Started` (as ktlong.session.startup.start makes it),
and uvicorn serving an app on a free local port, in a thread of the test process."""

import http.client
import json
import socket
import threading
import time

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

        plan = plan_session(config, lm.config, lm.num_weight_elements, max_seq_len, lm.model.device,
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
