# bash completion for quill(1), the TCP/UDP load balancer.
#
# Install as /usr/share/bash-completion/completions/quill (or source it from ~/.bashrc);
# see contrib/completions/README.md. Plain `compgen` only: it needs neither the
# bash-completion package nor its helper functions.
#
# The word lists are checked against quill itself by crates/quill/tests/completion.rs.

# The options of `quill --help`.
_quill_options='-r -h -N -W -s -O -H -x -c -t -b -T -e -B -f -d -U -C -X -F -l -w -p -u -j
-m -q -o -P -Q -D -n -a -S -E -K -G -A -R -L -Z --takeover --check --help --version'

# Short options whose value is the next word, or the rest of the word (`-x 500`, `-x500`).
_quill_value_letters='BCFOSTbceijlmopqtuwxEKGAL'

# What -O and -o accept: the configuration commands of the command language
# (crates/quill/src/command.rs; operations such as `servers` are for the control socket).
_quill_settings='server roundrobin hash hash_only stubborn weight prio tracking blacklist
timeout conn_max clients_max acl client_acl tcp_nodelay tcp_fastclose keepalive idle_timeout
idle_park poll_before_sleep defer_accept pending_max source dummy debug epoll poll select kqueue block delayed_forward ascii
emergency abuse multi_accept backlog workers udp_idle_timeout udp_responses listen control_acl
metrics_listen log web_stats abort_on_error geoip_db ssl_cert ssl_key ssl_ca ssl_ca_dir
ssl_verify_client ssl_protocol ssl_option ssl_ciphers ssl_sni_path ssl_ocsp_response
ssl_client_renegotiation_interval ssl_compat upstream_tls upstream_ca upstream_sni check
check_interval check_timeout check_rise check_fall slow_start shutdown_grace announce_table
announce_grace dsr_if dsr_path udp_offload
tarpit_acl transparent http http_header_max http_request_timeout hsts proxy_protocol
accept_proxy alpn h2c h2_max_streams upstream_keepalive upstream_idle_timeout
upstream_max_requests queue_timeout queue_max upstream_h2 access_log'

# The values of -L (ssl_protocol).
_quill_protocols='ssl23 tls1.2 tls1.3'

# Sets the caller's `words` and `cword` from COMP_WORDS and COMP_CWORD, with the pieces
# that COMP_WORDBREAKS cut at ':' or '=' glued back as the shell passes them: for quill,
# `localhost:8000` is one argument, not three words.
_quill_reassemble() {
    words=()
    local line=${COMP_LINE-} i word
    for ((i = 0; i <= COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if ((i > 0)) && [[ -n $line && $line != [[:space:]]* ]]; then
            words[${#words[@]} - 1]+=$word
        else
            words+=("$word")
        fi
        line=${line#"${line%%[![:space:]]*}"}
        line=${line:${#word}}
    done
    cword=$((${#words[@]} - 1))
}

# Readline replaces only the text after the last word-break character of the current
# word, so replies for a word such as `/run/a:b` drop what comes before it.
_quill_trim() {
    local breaks=${COMP_WORDBREAKS//[^:=]/} prefix k
    [[ -n $breaks && $1 == *["$breaks"]* ]] || return 0
    prefix=${1%"${1##*["$breaks"]}"}
    for k in "${!COMPREPLY[@]}"; do
        COMPREPLY[k]=${COMPREPLY[k]#"$prefix"}
    done
}

# Appends to COMPREPLY the lines compgen prints (one a line, so names with spaces survive).
_quill_compgen() {
    local line
    while IFS= read -r line; do
        COMPREPLY+=("$line")
    done < <(compgen "$@")
}

# Completes the value of short option $1 from the text $2.
_quill_value() {
    case $1 in
    F | l | w | p | E | K | G | C)
        compopt -o filenames 2>/dev/null
        _quill_compgen -f -- "$2"
        ;;
    A | j)
        compopt -o filenames 2>/dev/null
        _quill_compgen -d -- "$2"
        ;;
    u) _quill_compgen -u -- "$2" ;;
    L) _quill_compgen -W "$_quill_protocols" -- "$2" ;;
    O | o) _quill_compgen -W "$_quill_settings" -- "$2" ;;
    esac
}

# Fills COMPREPLY for the word words[cword], $1.
_quill_complete() {
    local cur=$1
    # Walk the words before the cursor as quill's parser does: which option, if any, the
    # current word is the value of, and how many positional arguments came before it.
    local i word j letter pending='' positional=0 options_done=''
    for ((i = 1; i < cword; i++)); do
        word=${words[i]}
        if [[ -n $pending ]]; then
            pending=''
        elif [[ -z $options_done && $word == -- ]]; then
            options_done=1
        elif [[ -z $options_done && $word == -?* && $word != --* ]]; then
            # A cluster of short flags (`-fr`); the first that takes a value takes the
            # rest of the word, or the next word when it ends the cluster.
            for ((j = 1; j < ${#word}; j++)); do
                letter=${word:j:1}
                if [[ $_quill_value_letters == *"$letter"* ]]; then
                    ((j == ${#word} - 1)) && pending=$letter
                    break
                fi
            done
        elif [[ -z $options_done && $word == --* ]]; then
            :
        else
            ((positional++))
        fi
    done

    if [[ -n $pending ]]; then
        _quill_value "$pending" "$cur"
        return
    fi
    if [[ -z $options_done && $cur == -* ]]; then
        # A word value written right after its option: -Oroundrobin, -Ltls1.3 (file
        # names are completed only as words of their own, where readline can quote them).
        local first=${cur:1:1}
        if [[ ${#cur} -gt 2 && $first == [OoL] ]]; then
            _quill_value "$first" "${cur:2}"
            local k
            for k in "${!COMPREPLY[@]}"; do
                COMPREPLY[k]="-$first${COMPREPLY[k]}"
            done
            return
        fi
        _quill_compgen -W "$_quill_options" -- "$cur"
        return
    fi
    # The listening address and the servers are the user's own; the first positional
    # argument may also be the demo.
    if ((positional == 0)); then
        _quill_compgen -W 'demo' -- "$cur"
    fi
    return
}

_quill() {
    COMPREPLY=()
    local -a words
    local cword
    _quill_reassemble
    _quill_complete "${words[cword]}"
    _quill_trim "${words[cword]}"
    return 0
}

complete -F _quill quill
