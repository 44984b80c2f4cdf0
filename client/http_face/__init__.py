"""vLLM's HTTP surface for RL frameworks, served over the gateway's socket (``engine-gateway
http``; the optional ``http`` extra: aiohttp).

A framework written against ``vllm serve`` (verifiers/prime-rl, TRL, SkyRL) changes only its
base URL: ``/inference/v1/generate`` becomes a Generate on a gateway (or a pool of them),
an HTTP request its client cancels becomes an Abort, and the admin routes (pause, resume,
weights, LoRA) become the gateway's control calls. docs/FRAMEWORKS.md says what each
framework sends and what the face does with it.

- ``bodies``: request bodies, checked as vLLM checks them, into the gateway's structs;
- ``responses``: RequestOutputs into vLLM's response and SSE shapes;
- ``replies``: vLLM's error shape, and reading bodies and queries;
- ``app``: the aiohttp application, generate, models and health (``HttpFace``);
- ``completions``: ``/v1/completions`` with token-id prompts (TRL);
- ``control``: the control routes (pause, weights, LoRA, sleep);
- ``cli``: ``engine-gateway http``.
"""
