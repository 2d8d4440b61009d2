"""Asynchronous RL of the agent (issue 7). Built so far: the pure pieces, rewards.py (the
length penalty and the k1 KL term) and loss.py (group advantages and the Dr. GRPO policy loss)."""
