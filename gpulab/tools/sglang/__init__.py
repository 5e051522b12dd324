"""Stand-in for the SGLang package inside lab hosts (``python3 -m sglang.launch_server ...``)."""

__version__ = "0.4.6.post5"
