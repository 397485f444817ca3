"""Score documents against a query with the ScoreDocs gRPC API.

python examples/client.py --target 127.0.0.1:50051

A long-lived service keeps one channel open rather than one per call.
"""

from __future__ import annotations

import argparse

import grpc

from scorer.v1 import scorer_pb2, scorer_pb2_grpc


def rank(target: str, query: str, docs: dict[str, str], top_n: int = 0) -> scorer_pb2.ScoreDocsResponse:
    with grpc.insecure_channel(target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        request = scorer_pb2.ScoreDocsRequest(
            prompt=query,
            docs=[scorer_pb2.Doc(id=doc_id, text=text) for doc_id, text in docs.items()],
            options=scorer_pb2.ScoreOptions(scheme="auto", top_n=top_n),
            request_id="example-1",
        )
        # the deadline again as x-timeout-ms: Ray Serve's gRPC proxy passes metadata on, not deadlines
        return stub.ScoreDocs(request, timeout=10.0, metadata=(("x-timeout-ms", "10000"),))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    args = parser.parse_args()
    docs = {
        "rope": "Rotary position embeddings rotate query and key vectors by position.",
        "prefix": "A shared prefix is computed once and its keys and values are reused.",
        "bread": "Sourdough bread needs a starter, flour, water and salt.",
    }
    try:
        response = rank(args.target, "how does prefix caching work", docs, top_n=2)
    except grpc.RpcError as e:
        # INVALID_ARGUMENT names the field in its details and in the x-invalid-field trailer;
        # RESOURCE_EXHAUSTED means the server is full: retry with backoff.
        raise SystemExit(f"{e.code().name}: {e.details()}") from None
    for r in response.results:
        print(f"{r.index} {r.id:8} {r.score:.4f}")
    u = response.usage
    print(f"scheme={response.scheme} model={response.model} request_id={response.request_id}")
    # usage.tokens_computed and timing depend on the server's state (its prefix cache, its load)
    once = f"the prompt is computed once, not {len(docs)} times"
    print(f"prompt tokens={u.prompt_tokens} doc tokens={u.doc_tokens}: {once}")


if __name__ == "__main__":
    main()
