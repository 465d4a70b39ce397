"""The device runner: the jitted step programs, multi-step calls and host-device transfers."""
