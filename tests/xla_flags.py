"""XLA flags that make the test processes compile faster; set before jax starts.

Compiling dominates the suite. XLA:CPU's backend optimisation off and its older fusion
emitters cut a test process's compile time by about half; they change how fast compiled
code runs, not what it computes. The test processes (tests/conftest.py), the scripts they
start (they inherit XLA_FLAGS) and the helpers that set their own device count use them.
"""

import os
import subprocess
import sys

FAST_COMPILE = ('--xla_backend_optimization_level=0', '--xla_cpu_use_fusion_emitters=false')
_PROBED = 'DSPEC_TEST_FAST_COMPILE_FLAGS'


def fast_compile_flags() -> str:
  """`FAST_COMPILE` as far as this jaxlib knows the flags (XLA aborts on an unknown one):
  probed once per test run in a throwaway process, then read from the environment."""
  if _PROBED not in os.environ:
    probe = subprocess.run([sys.executable, '-c', 'import jax; jax.devices()'],
                           env=dict(os.environ, XLA_FLAGS=' '.join(FAST_COMPILE),
                                    JAX_PLATFORMS='cpu'),
                           capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    os.environ[_PROBED] = ' '.join(FAST_COMPILE if probe.returncode == 0 else FAST_COMPILE[:1])
  return os.environ[_PROBED]


def with_fast_compile(xla_flags: str = '') -> str:
  """`xla_flags` plus the fast-compile flags it does not set already."""
  names = {f.split('=', 1)[0] for f in xla_flags.split()}
  extra = [f for f in fast_compile_flags().split() if f.split('=', 1)[0] not in names]
  return ' '.join(xla_flags.split() + extra)


def cpu_env(devices: int, **env) -> dict:
  """The environment of a JAX process a test starts on `devices` simulated CPU devices,
  with the fast-compile flags (and `env`'s variables)."""
  return dict(os.environ, JAX_PLATFORMS='cpu', **env, XLA_FLAGS=with_fast_compile(
      f'--xla_force_host_platform_device_count={devices}'))
