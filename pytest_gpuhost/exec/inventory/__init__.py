"""Target inventories read as Ansible reads them (`load` is the front: load_inventory, select_targets).

`formats` parses YAML, INI and `ansible-inventory --list` JSON into a `model`; `dirs` reads
`group_vars/` and `host_vars/`; `vars` maps Ansible's connection variables onto a TargetSpec;
`names` checks host names and expands ranges; `pattern` compiles `--limit` host patterns;
`ansible` reads any source through `ansible-inventory --list` (plugin configs, directories).
"""
