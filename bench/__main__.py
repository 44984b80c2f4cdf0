"""`python -m bench ...`: see bench/cli.py."""

from .cli import main

if __name__ == "__main__":
    from gateway.quick_exit import exit_now

    exit_now(main())  # without the teardown: vLLM's imports made it slow and noisy
