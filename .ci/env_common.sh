# Sourced by .ci/make_*_env.sh once `dest` (the venv) and `repo` (this checkout) are set.

pip_install() {
    # pip.conf names local index directories that may be absent: drop pip's warnings about them.
    # --no-compile: bytecode is written on first import instead, for the few modules the tests load.
    "$dest/bin/python" -m pip install -q --disable-pip-version-check --no-input --no-compile "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

install_checkout() {
    # Editable installs write build metadata into the checkout: one at a time when CI builds envs side by side.
    mkdir -p "$repo/.ci/envs"
    flock "$repo/.ci/envs/.editable.lock" "$dest/bin/python" -m pip install -q --disable-pip-version-check \
        --no-input --no-compile --no-deps -e "$repo" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
