"""Actor (policy training) code: GRPO losses and a plain-torch trainer."""
