"""Same as `python -m relu_ext.bench` (see src/relu_ext/bench/), for running from a checkout."""

from relu_ext.bench.cli import main

if __name__ == "__main__":
    main()
