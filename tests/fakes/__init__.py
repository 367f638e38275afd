"""Fakes for what lies outside the process (NVML, …), shaped like the real boundary."""
