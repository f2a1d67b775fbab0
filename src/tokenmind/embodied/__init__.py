"""Embodied policies on PushT: the environment (`env`), a scripted expert (`expert`), recorded
demonstrations (`demos`), evaluation in simulation (`evaluate`), and the policies trained on them by
behaviour cloning. See docs/embodied.md."""
