"""SSH to targets: the OpenSSH client (`openssh`, its `direct` login, `bulk` channels,
`client_facts`), and paramiko (`paramiko`, `paramiko_channel`, `config`) where no `ssh` exists;
`hostkeys` checks known_hosts for both."""
