"""KeyDoorMaze: every generated layout is solvable and needs the key (NumPy BFS over many
seeds), and walking the BFS route through the environment reaches the goal."""

import itertools
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

import ember.envs
from ember.envs.maze import MOVES
from tests.tolerances import assert_allclose

ENV, PARAMS = ember.envs.make("KeyDoorMaze-v0")
RESET = jax.jit(ENV.reset)
STEP = jax.jit(ENV.step)  # compiled once for the module: the maze's reset makes it slow to compile


def bfs_path(walls, start, goal, blocked=()):
    """Shortest list of squares from ``start`` to ``goal`` avoiding walls and ``blocked``; None if none."""
    start, goal = tuple(int(v) for v in start), tuple(int(v) for v in goal)
    previous = {start: None}
    queue = deque([start])
    while queue:
        square = queue.popleft()
        if square == goal:
            path = []
            while square is not None:
                path.append(square)
                square = previous[square]
            return path[::-1]
        for dr, dc in MOVES:
            nxt = (square[0] + dr, square[1] + dc)
            inside = 0 <= nxt[0] < walls.shape[0] and 0 <= nxt[1] < walls.shape[1]
            if inside and not walls[nxt] and nxt not in previous and nxt not in blocked:
                previous[nxt] = square
                queue.append(nxt)
    return None


def test_every_layout_is_solvable_and_needs_the_key(rng):
    _, states = jax.jit(jax.vmap(ENV.reset, in_axes=(0, None)))(jax.random.split(rng, 300), PARAMS)
    states = jax.tree.map(np.asarray, states)
    layouts = set()
    for i in range(300):
        walls, agent, key, door, goal = (
            states.walls[i],
            states.agent[i],
            states.key[i],
            states.door[i],
            states.goal[i],
        )
        door_square = (tuple(door),)
        assert not walls[tuple(door)] and not walls[tuple(key)] and not walls[tuple(goal)]
        assert bfs_path(walls, agent, key, blocked=door_square) is not None, f"seed {i}: key behind the door"
        assert bfs_path(walls, key, goal) is not None, f"seed {i}: goal unreachable"
        assert bfs_path(walls, agent, goal, blocked=door_square) is None, f"seed {i}: goal reachable without the door"
        # A perfect maze on 5x5 rooms: 25 rooms + 24 corridors open, everything connected.
        assert int((~walls).sum()) == 49
        layouts.add(walls.tobytes())
    assert len(layouts) > 250, "a new layout every episode"


def action_towards(square, nxt):
    return [tuple(m) for m in MOVES].index((nxt[0] - square[0], nxt[1] - square[1]))


def test_walking_the_bfs_route_picks_the_key_opens_the_door_and_scores(rng):
    params, step = PARAMS, STEP
    _obs, state = RESET(rng, params)
    walls = np.asarray(state.walls)
    door = (tuple(np.asarray(state.door)),)
    route = bfs_path(walls, state.agent, state.key, blocked=door) + bfs_path(walls, state.key, state.goal)[1:]
    for t, (square, nxt) in enumerate(itertools.pairwise(route)):
        if square == nxt:
            continue
        _obs, state, reward, terminated, _truncated, info = step(
            jax.random.fold_in(rng, t), state, action_towards(square, nxt), params
        )
        if nxt != route[-1]:
            assert tuple(np.asarray(state.agent)) == nxt
            assert float(reward) == 0.0 and not bool(terminated)
    assert bool(terminated)
    steps = len(route) - 1 - sum(a == b for a, b in itertools.pairwise(route))
    assert_allclose(reward, 1.0 - 0.9 * steps / params.max_steps_in_episode)
    assert_allclose(info["final_observation"]["has_key"], [1.0])


def test_locked_door_blocks_and_view_is_agent_centred(rng):
    params, step = PARAMS, STEP
    _, state = RESET(rng, params)
    door = np.asarray(state.door)
    # Put the agent next to the door (on the side it comes from) without the key.
    # move_index is used after the loop (the search breaks on the first free side), which B007 does not see
    for move_index, move in enumerate(MOVES):  # noqa: B007
        beside = door - move
        if not bool(state.walls[tuple(beside)]) and tuple(beside) != tuple(np.asarray(state.goal)):
            break
    # The key goes into a wall corner so that standing still cannot pick it up.
    placed = state.replace(agent=jnp.asarray(beside, jnp.int32), key=jnp.zeros(2, jnp.int32))
    obs, after, *_ = step(rng, placed, move_index, params)
    np.testing.assert_array_equal(after.agent, beside)
    _, after, *_ = step(rng, placed.replace(has_key=jnp.asarray(True)), move_index, params)
    np.testing.assert_array_equal(after.agent, door)
    view = np.asarray(obs["view"])  # the agent did not move: the view around `beside`
    row, col = beside
    for dr in (-2, -1, 0, 1, 2):
        for dc in (-2, -1, 0, 1, 2):
            r, c = row + dr, col + dc
            expected_wall = not (0 <= r < 11 and 0 <= c < 11) or bool(state.walls[r, c])
            assert view[2 + dr, 2 + dc, 0] == float(expected_wall)
    assert view[2 + move[0], 2 + move[1], 2] == 1.0, "the locked door is in view, next to the agent"


def test_reset_and_observation_work_with_x64_enabled(rng):
    # Under jax_enable_x64 the view's third slice index (a Python 0) became int64 beside the
    # int32 agent position, and dynamic_slice raised TypeError: every reset and step crashed.
    expected_obs, state = RESET(rng, PARAMS)
    with jax.enable_x64(True):
        obs, state64 = ENV.reset(rng, PARAMS)
        step_obs = ENV.observation(state, PARAMS)
    jax.tree.map(np.testing.assert_array_equal, (obs, state64, step_obs), (expected_obs, state, expected_obs))
    assert obs["view"].dtype == jnp.float32 and state64.agent.dtype == jnp.int32
