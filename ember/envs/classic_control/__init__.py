"""Classic-control environments with gymnasium's dynamics, rewards, termination and time limits."""
