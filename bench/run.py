"""Same as `python -m relu_ext.bench` (see src/relu_ext/bench.py), for running from a checkout."""

from relu_ext.bench import main

if __name__ == "__main__":
    main()
