"""vLLM's HTTP surface for RL frameworks, served over the gateway's socket (``engine-gateway
http``; the optional ``http`` extra: aiohttp).

A framework written against ``vllm serve`` (verifiers/prime-rl, TRL, SkyRL) changes only its
base URL: ``/inference/v1/generate`` becomes a Generate on a gateway (or a pool of them),
an HTTP request its client cancels becomes an Abort, and the admin routes (pause, resume,
weights, LoRA) become the gateway's control calls. docs/FRAMEWORKS.md says what each
framework sends and what the face does with it.

- ``bodies``: request bodies, checked as vLLM checks them, into the gateway's structs;
- ``limits``: the face's bounds per request (prompts, samples, body bytes);
- ``access``: who a caller is and what it may make the face do (``Caller``, ``Access``);
- ``fairness``: the callers' shares of the gateways' budget (``CallerSlots``);
- ``admitted``: a request that starts once its caller has a slot (``AdmittedStream``);
- ``pieces``: outputs of the token and text paths as one shape (``Piece``, ``Sample``);
- ``responses``: those into vLLM's response and SSE shapes;
- ``replies``: vLLM's error shape, and reading bodies and queries;
- ``text``: text prompts (bounded, encoded off the loop) and vLLM's text fields;
- ``app``: the aiohttp application, models and health (``HttpFace``);
- ``generate``: ``/inference/v1/generate``'s answer, whole or streamed;
- ``completions``: ``/v1/completions`` (TRL);
- ``control``: the control routes (pause, weights, LoRA, sleep);
- ``cli``: ``engine-gateway http``.
"""
