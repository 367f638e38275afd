"""What a running session serves through the console: its apps (the app proxy on its own origin) and its files."""
