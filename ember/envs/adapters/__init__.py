"""Adapters between Ember's environment contract and other libraries':

* ``GymnaxEnv``: a gymnax environment as an Ember ``Environment`` (terminated/truncated
  split, ``final_observation``, batched randomness), so Ember's algorithms run it;
* ``JaxMARLEnv``: a JaxMARL environment as an Ember ``MultiAgentEnvironment``;
* ``GymnasiumVectorEnv``: any Ember environment as a ``gymnasium.vector.VectorEnv``;
* ``to_gymnasium_space``: an Ember space as a gymnasium space.

gymnax, JaxMARL and gymnasium are imported only by the adapter that needs them.
"""

from ember.envs.adapters.gymnasium_vector import GymnasiumVectorEnv, to_gymnasium_space
from ember.envs.adapters.gymnax import GymnaxEnv, from_library_space
from ember.envs.adapters.jaxmarl import JaxMARLEnv

__all__ = ["GymnasiumVectorEnv", "GymnaxEnv", "JaxMARLEnv", "from_library_space", "to_gymnasium_space"]
