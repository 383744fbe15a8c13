"""vLLM's OpenAI-compatible server on the neuron platform, on loopback.

Started as users start it (``python -m vllm.entrypoints.openai.api_server --model DIR``),
asked for completions and chat completions (plain and streamed), compared with Hugging Face
greedy decoding on CPU, then stopped with SIGINT: it must exit by itself, with status 0, and
take its engine process with it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from serving_support import serving_env

import tiny_models

PROMPT = "Hello, my name is"
MESSAGES = [{"role": "user", "content": "How are you today?"}]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if not stream:
            return json.loads(r.read())
        chunks = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
            elif line == "data: [DONE]":
                chunks.append("[DONE]")
        return chunks


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", llama_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5",
           "--enforce-eager", "--seed", "0"]
    proc = subprocess.Popen(cmd, env=serving_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{_tail(log)}"
            assert time.monotonic() < deadline, f"server not ready in 180 s:\n{_tail(log)}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield {"base": base, "proc": proc, "log": log, "model": llama_dir}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-5000:]


@pytest.fixture(scope="module")
def hf_ids(llama_dir):
    """HF greedy token ids for the completion prompt and the templated chat prompt. (The
    random model emits arbitrary byte-level tokens, so ids are compared, not text.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    chat_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tiny_models.hf_greedy(llama_dir, [PROMPT, chat_prompt], MAX_TOKENS)


def _completion_body(server, **kw):
    return dict(model=server["model"], prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                ignore_eos=True, return_token_ids=True, **kw)


def _chat_body(server, **kw):
    return dict(model=server["model"], messages=MESSAGES, max_tokens=MAX_TOKENS,
                temperature=0.0, ignore_eos=True, return_token_ids=True, **kw)


@pytest.fixture(scope="module")
def completion(server):
    return _post(server["base"] + "/v1/completions", _completion_body(server))


@pytest.fixture(scope="module")
def chat(server):
    return _post(server["base"] + "/v1/chat/completions", _chat_body(server))


def test_completions_equal_hf(completion, hf_ids):
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] == MAX_TOKENS
    assert completion["choices"][0]["token_ids"] == hf_ids[0]


def test_streamed_completions_equal_the_plain_ones(server, completion):
    chunks = _post(server["base"] + "/v1/completions", _completion_body(server, stream=True),
                   stream=True)
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
    body = [c["choices"][0] for c in chunks[:-1] if c["choices"]]
    assert sum((c.get("token_ids") or [] for c in body), []) == completion["choices"][0]["token_ids"]
    assert "".join(c["text"] for c in body) == completion["choices"][0]["text"]


def test_chat_completions_equal_hf(chat, hf_ids):
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["token_ids"] == hf_ids[1]


def test_streamed_chat_completions_equal_the_plain_ones(server, chat):
    chunks = _post(server["base"] + "/v1/chat/completions", _chat_body(server, stream=True),
                   stream=True)
    assert chunks[-1] == "[DONE]"
    body = [c["choices"][0] for c in chunks[:-1] if c["choices"]]
    assert sum((c.get("token_ids") or [] for c in body), []) == chat["choices"][0]["token_ids"]
    text = "".join(c["delta"].get("content") or "" for c in body)
    assert text == chat["choices"][0]["message"]["content"]


def test_server_shuts_down_cleanly_on_sigint(server):
    proc = server["proc"]
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the engine core should run in its own process"
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("server still running 60 s after SIGINT:\n" + _tail(server["log"]))
    assert code == 0, _tail(server["log"])
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"engine processes left behind: {alive}"
    assert "Traceback" not in _tail(server["log"])
