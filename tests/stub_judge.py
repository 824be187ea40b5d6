"""A deterministic OpenAI-compatible judge on 127.0.0.1 for offline annotation tests.

It reads the two outputs of AlpacaEval's prompt ("m" then "M") and prefers the longer one with
probability ``confidence``, answering one token with its top log-probabilities, as the real API does.
``fail_first`` requests get HTTP 500 first (to exercise retries); ``mode="broken"`` always fails.
"""
from __future__ import annotations

import json
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OUTPUT = r'"model_identifier": "{}",\s*"output": """(.*?)"""'


class StubJudge:
    def __init__(self, confidence: float = 0.9, fail_first: int = 0, mode: str = "ok"):
        self.confidence, self.fail_first, self.mode = confidence, fail_first, mode
        self.requests = 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests += 1
                    failing = judge.mode == "broken" or judge.requests <= judge.fail_first
                if failing:
                    self.send_response(500)
                    self.end_headers()
                    return
                payload = json.dumps(judge.answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, body: dict) -> dict:
        prompt = "\n".join(m["content"] for m in body["messages"])
        first, second = (re.search(OUTPUT.format(t), prompt, re.S).group(1) for t in ("m", "M"))
        p_first = self.confidence if len(first) > len(second) else 1 - self.confidence
        top = [{"token": "m", "logprob": math.log(p_first), "bytes": None},
               {"token": "M", "logprob": math.log(1 - p_first), "bytes": None}]
        token = "m" if p_first > 0.5 else "M"
        return {"id": f"stub-{self.requests}", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": token},
                             "logprobs": {"content": [{"token": token, "logprob": max(t["logprob"] for t in top),
                                                       "bytes": None, "top_logprobs": top}]}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
