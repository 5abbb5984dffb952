import httpx

QS = ["Tell me everything about Quendor.", "Describe the Melbrook valley in detail.",
      "Write a long story about the Vantir mountains.", "What happens at the harvest festival?"]


def test_probe(gateway, documents):
    for doc in (None, ["rivers"], ["orchards"], ["mountains"]):
        for q in QS:
            body = {"question": q, "max_tokens": 700, "top_k": 2}
            if doc:
                body["doc_ids"] = doc
            r = httpx.post(f"{gateway.url}/v1/query", json=body, timeout=300).json()
            print("PROBE", doc, q, r["finish_reason"], r["usage"]["completion_tokens"], r["timings"]["total_s"])
