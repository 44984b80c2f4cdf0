"""Native adapters for RL frameworks (issue 70): each framework's own client class, served
over the gateway's socket. Each module needs its framework installed (in the framework's
venv) and this package's client (pyzmq, msgspec); docs/FRAMEWORKS.md says which versions."""
