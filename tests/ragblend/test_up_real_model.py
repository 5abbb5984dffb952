"""`ragblend up` as a new user meets it: no --model, no --documents; SmolLM2 from its package,
the bundled real documents, and the banner's question answered with the right fact, also to
the `openai` client with its default arguments."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ragblend.banner import read_questions
from ragblend.up import SAMPLES_DIR
from tests import real_model
from tests.service_process import REPO_ROOT, free_port, service_env

smollm2_dir = real_model.smollm2_dir


def _banner_question(log: str) -> str:
    line = next(p for p in log.split("ragblend is up", 1)[1].splitlines() if "-d '" in p)
    return json.loads(shlex.split(line.strip())[1])["question"]


# Minutes on 2 loaded cores: three services start, three documents are precomputed.
@pytest.mark.timeout(1200)
def test_up_by_default_serves_smollm2_and_answers_the_banner_question(smollm2_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    # The conversion every test run shares stands in for the first start's (minutes).
    (data / "models").symlink_to(real_model.model_cache_dir(), target_is_directory=True)
    ports = {name: free_port() for name in ("gateway", "retriever", "engine")}
    command = [sys.executable, "-m", "ragblend", "up", "--data-dir", str(data)]
    command += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    # The pool's default, a quarter of the RAM available when the engine starts, is whatever
    # the test running beside this one left (once 0.14 GiB: no 8192-position sequence fit).
    env = service_env(RAGBLEND_GATEWAY_TTFT_TIMEOUT_S="300", RAGBLEND_ENGINE_KV_POOL_GB="1")
    env.pop("RAGBLEND_ENGINE_MODEL", None)
    env.pop("RAGBLEND_ENGINE_DTYPE", None)
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as out:
        up = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 900
        while "ragblend is up" not in (log := log_path.read_text(errors="replace")):
            assert up.poll() is None and time.monotonic() < deadline, log[-3000:]
            time.sleep(0.5)
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        documents = httpx.get(f"{gateway}/v1/documents", timeout=30).json()["documents"]
        sources = {d["metadata"]["source"] for d in documents}
        assert sources == {p.name for p in SAMPLES_DIR.glob("*.md")}
        # The chunks' KV is precomputed in the background; the question is asked once it is
        # there, as a user who reads the banner first would.
        for document in documents:
            url = f"{gateway}/v1/documents/{document['doc_id']}"
            while httpx.get(url, timeout=30).json()["precompute"]["status"] == "pending":
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
                time.sleep(1.0)
        asked = _banner_question(log)
        (expected,) = [q for q in read_questions(SAMPLES_DIR) if q.question == asked]
        health = httpx.get(f"http://127.0.0.1:{ports['engine']}/health", timeout=30).json()
        assert health["model"] == "SmolLM2-135M-Instruct.Q4_1"
        response = httpx.post(
            f"{gateway}/v1/query",
            json={"question": expected.question, "top_k": 3, "max_tokens": 24},
            timeout=600,
        )
        assert response.status_code == 200, response.text
        answer = response.json()["answer"]
        assert expected.fact in answer, answer
        # The openai client with its default arguments: no temperature, so the engine's
        # defaults for the bundled model, not OpenAI's 1.0 (noise from a 135M model).
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=600)
        chat = client.chat.completions.create(
            model=health["model"], messages=[{"role": "user", "content": expected.question}]
        )
        reply = chat.choices[0].message.content
        assert reply is not None and expected.fact in reply, reply
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
