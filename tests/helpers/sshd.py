"""Session fixture `sshd`: OpenSSH's sshd on loopback with its own host key (filled in by the execution work)."""
