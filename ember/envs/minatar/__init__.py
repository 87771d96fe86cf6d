"""MinAtar games (Young & Tian, 2019): 10x10 Atari-like grids with one channel per object."""
