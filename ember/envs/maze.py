"""``KeyDoorMaze-v0``: a procedurally generated, partially observed key-and-door maze for
memory and exploration research.

Every episode draws a new perfect maze (a uniformly weighted random spanning tree over
``cells x cells`` rooms on a ``[2 cells + 1]^2`` grid, grown by Prim's algorithm), then places the agent, a goal, a
locked door on the corridor just before the goal (so every route to the goal crosses it)
and a key somewhere the agent can reach without crossing the door -- so every layout is
solvable, and needs the key.

Actions 0/1/2/3 move up/right/down/left; walls and the locked door block. Walking onto the
key picks it up; with the key the door is passable (and no longer shown). Reaching the goal terminates
with reward ``1 - 0.9 * time / max_steps_in_episode`` (MiniGrid's); every other step gives 0.

Observation (a dict):
  * ``"view"``: float32 ``[view, view, 4]`` 0/1 channels (wall, key, door, goal) of the
    squares around the agent, agent at the centre (squares off the grid read as wall);
  * ``"has_key"``: float32 ``[1]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ember.envs import noise as noise_lib
from ember.envs import rendering
from ember.envs.environment import Environment, EnvParams, EnvState
from ember.envs.spaces import Box, Dict, Discrete

MOVES = np.array([[-1, 0], [0, 1], [1, 0], [0, -1]])  # (row, col) for up, right, down, left


@struct.dataclass
class MazeState(EnvState):
    walls: jax.Array  # [grid, grid] bool
    agent: jax.Array  # [2] int32 (row, col)
    key: jax.Array  # [2] int32; meaningless once picked up
    door: jax.Array  # [2] int32
    goal: jax.Array  # [2] int32
    has_key: jax.Array  # bool


@struct.dataclass
class MazeParams(EnvParams):
    max_steps_in_episode: int = 250


def _room_edges(cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of neighbouring rooms ``[edges, 2]`` (room index = row * cells + col) and the
    grid square of the corridor joining each pair ``[edges, 2]``."""
    pairs, corridors = [], []
    for row in range(cells):
        for col in range(cells):
            if col + 1 < cells:
                pairs.append((row * cells + col, row * cells + col + 1))
                corridors.append((2 * row + 1, 2 * col + 2))
            if row + 1 < cells:
                pairs.append((row * cells + col, (row + 1) * cells + col))
                corridors.append((2 * row + 2, 2 * col + 1))
    return np.array(pairs), np.array(corridors)


def num_room_edges(cells: int) -> int:
    return 2 * cells * (cells - 1)


def generate_walls(edge_words: jax.Array, start_word: jax.Array, cells: int) -> jax.Array:
    """A perfect maze: ``[2 cells + 1, 2 cells + 1]`` bool walls. ``edge_words`` (uint32
    ``[num_room_edges(cells)]``) are random edge weights, ``start_word`` picks the first
    room; Prim's algorithm then adds the lightest edge leaving the tree until it spans."""
    pairs, corridors = _room_edges(cells)
    pairs = jnp.asarray(pairs)
    num_rooms = cells * cells
    start = noise_lib.randint(start_word, 0, num_rooms)

    def grow(_, carry):
        in_tree, opened = carry
        inside = in_tree[pairs]
        frontier = inside[:, 0] != inside[:, 1]
        edge = jnp.argmin(jnp.where(frontier, edge_words, jnp.uint32(0xFFFFFFFF)))
        return in_tree.at[pairs[edge]].set(True), opened.at[edge].set(True)

    in_tree = jnp.zeros(num_rooms, bool).at[start].set(True)
    _, opened = jax.lax.fori_loop(0, num_rooms - 1, grow, (in_tree, jnp.zeros(len(pairs), bool)))
    grid = 2 * cells + 1
    open_squares = jnp.zeros((grid, grid), bool).at[1::2, 1::2].set(True)
    open_squares = open_squares.at[corridors[:, 0], corridors[:, 1]].max(opened)
    return ~open_squares


def reachable(passable: jax.Array, source: jax.Array) -> jax.Array:
    """Squares reachable from ``source`` ([2]) through ``passable`` squares ([grid, grid] bool),
    by repeated 4-neighbour dilation (a breadth-first flood fill of fixed length)."""
    grid = passable.shape[0]
    seed = jnp.zeros_like(passable).at[source[0], source[1]].set(True)

    def dilate(_, region):
        padded = jnp.pad(region, 1)
        grown = region | padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
        return grown & passable

    # A path visits each open square once at most; half the grid bounds their number.
    return jax.lax.fori_loop(0, (grid * grid) // 2 + 1, dilate, seed)


def _pick(word: jax.Array, mask: jax.Array) -> jax.Array:
    """A uniformly random ``[2]`` (row, col) among the true squares of ``mask`` (not empty)."""
    flat = mask.ravel()
    chosen = noise_lib.randint(word, 0, flat.sum())
    index = jnp.argmax(jnp.cumsum(flat) > chosen)
    return jnp.stack([index // mask.shape[1], index % mask.shape[1]]).astype(jnp.int32)


class KeyDoorMaze(Environment):
    """``cells`` rooms per side (the grid is ``2 cells + 1`` squares wide) and the odd side
    ``view`` of the egocentric window fix array shapes, so they are constructor arguments."""

    def __init__(self, cells: int = 5, view: int = 5):
        if not isinstance(cells, int) or cells < 2:
            raise ValueError(f"KeyDoorMaze: cells must be an int >= 2, got {cells!r}")
        if not isinstance(view, int) or view < 1 or view % 2 == 0:
            raise ValueError(f"KeyDoorMaze: view must be an odd int >= 1, got {view!r}")
        self.cells, self.view = cells, view
        # Edge weights, the first room, then the agent, goal and key squares.
        self.reset_noise_words = num_room_edges(cells) + 4

    @property
    def default_params(self) -> MazeParams:
        return MazeParams()

    def reset_env(self, noise, params):
        edges = num_room_edges(self.cells)
        walls = generate_walls(noise[:edges], noise[edges], self.cells)
        agent_word, goal_word, key_word = noise[edges + 1], noise[edges + 2], noise[edges + 3]
        grid = walls.shape[0]
        rooms = jnp.zeros((grid, grid), bool).at[1::2, 1::2].set(True)
        agent = _pick(agent_word, rooms)
        goal = _pick(goal_word, rooms & ~_square(grid, agent))
        # The door: the corridor next to the goal on the way from the agent, i.e. the open
        # neighbour of the goal that is closer to the agent (the maze is a tree).
        from_agent = reachable(~walls & ~_square(grid, goal), agent)
        neighbours = goal[None, :] + jnp.asarray(MOVES)
        inside = jnp.all((neighbours >= 0) & (neighbours < grid), axis=1)
        clipped = jnp.clip(neighbours, 0, grid - 1)
        on_path = inside & from_agent[clipped[:, 0], clipped[:, 1]]
        door = clipped[jnp.argmax(on_path)]
        key_region = reachable(~walls & ~_square(grid, door), agent) & rooms
        key_region = jnp.where(
            (key_region & ~_square(grid, agent)).any(), key_region & ~_square(grid, agent), key_region
        )
        key = _pick(key_word, key_region)
        state = MazeState(
            time=jnp.int32(0), walls=walls, agent=agent, key=key, door=door, goal=goal, has_key=jnp.asarray(False)
        )
        return self.observation(state, params), state

    def step_env(self, noise, state, action, params):
        target = state.agent + jnp.asarray(MOVES)[action]
        grid = state.walls.shape[0]
        target = jnp.clip(target, 0, grid - 1)
        at = lambda square: jnp.all(target == square)  # noqa: E731
        blocked = state.walls[target[0], target[1]] | (at(state.door) & ~state.has_key)
        agent = jnp.where(blocked, state.agent, target)
        reached = lambda square: jnp.all(agent == square)  # noqa: E731
        has_key = state.has_key | reached(state.key)
        terminated = reached(state.goal)
        reward = jnp.where(terminated, 1.0 - 0.9 * (state.time + 1) / params.max_steps_in_episode, 0.0)
        state = state.replace(agent=agent, has_key=has_key)
        return self.observation(state, params), state, reward.astype(jnp.float32), terminated, {}

    def layers(self, state: MazeState) -> jax.Array:
        """The whole grid as float32 ``[grid, grid, 4]`` channels (wall, key, door, goal)."""
        grid = state.walls.shape[0]
        key = _square(grid, state.key) & ~state.has_key
        door = _square(grid, state.door) & ~state.has_key
        return jnp.stack([state.walls, key, door, _square(grid, state.goal)], axis=-1).astype(jnp.float32)

    def observation(self, state: MazeState, params: MazeParams) -> dict:
        half = self.view // 2
        layers = self.layers(state)
        margin = ((half, half), (half, half), (0, 0))
        padded = jnp.concatenate(
            [jnp.pad(layers[..., :1], margin, constant_values=1.0), jnp.pad(layers[..., 1:], margin)], axis=-1
        )
        # All three indices int32: a Python 0 is int64 under jax_enable_x64, and dynamic_slice
        # refuses mixed index types.
        start = (state.agent[0], state.agent[1], jnp.zeros_like(state.agent[0]))
        view = jax.lax.dynamic_slice(padded, start, (self.view, self.view, 4))
        return {"view": view, "has_key": state.has_key.astype(jnp.float32)[None]}

    def observation_space(self, params):
        return Dict({"view": Box(0.0, 1.0, (self.view, self.view, 4)), "has_key": Box(0.0, 1.0, (1,))})

    def action_space(self, params):
        return Discrete(4)

    def render(self, state, params, cell_pixels: int = 12):
        layers = self.layers(state).astype(bool)
        colours = [(40, 40, 40), (230, 200, 40), (150, 80, 30), (60, 180, 80)]  # channels 0-3, later on top
        drawn = [(layers[..., channel], colour) for channel, colour in enumerate(colours)]
        drawn.append((_square(layers.shape[0], state.agent), (220, 50, 50)))  # the agent on top
        return rendering.layered_grid_image(drawn, (240, 240, 240), cell_pixels)


def _square(grid: int, position: jax.Array) -> jax.Array:
    """``[grid, grid]`` bool, true only at ``position`` ([2] row, col)."""
    rows, cols = jnp.arange(grid)[:, None], jnp.arange(grid)[None, :]
    return (rows == position[0]) & (cols == position[1])
