#!/bin/bash
# Terminal-Bench 1.0 installs pytest here (uv, from the network); this machine has none, and
# the harness supplies the host's pytest where the image lacks one.
pytest $TEST_DIR/test_outputs.py -rA
