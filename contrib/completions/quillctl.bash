# bash completion for quillctl(1): `quillctl [host:]port|/path/to/socket command [args...]`.
#
# Install as /usr/share/bash-completion/completions/quillctl (or source it from ~/.bashrc);
# see contrib/completions/README.md. Plain `compgen` only: it needs neither the
# bash-completion package nor its helper functions.
#
# The word lists are checked against quill itself by crates/quill/tests/completion.rs.

# Control sockets offered when the address is still empty (the systemd units' -C).
_quillctl_sockets_glob='/run/quill/*.ctl'

# The configuration commands of the command language (crates/quill/src/command.rs).
_quillctl_settings='server roundrobin hash hash_only stubborn weight prio tracking blacklist
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

# Operations on the running process, for the control socket only.
_quillctl_operations='servers status mode recent connection connections close control pid include write
exit health drain'

# The commands that have a `no` form.
_quillctl_negatable='roundrobin hash hash_only stubborn weight prio tcp_nodelay keepalive dummy
source emergency abuse block delayed_forward ascii acl log web_stats metrics_listen
abort_on_error ssl_cert ssl_key ssl_ca ssl_ca_dir ssl_verify_client ssl_option ssl_ciphers
ssl_sni_path ssl_ocsp_response ssl_compat upstream_tls upstream_ca upstream_sni check
tarpit_acl transparent http hsts proxy_protocol accept_proxy announce_table alpn h2c access_log
upstream_h2 udp_offload'

# The fields of `server N field value ...`.
_quillctl_server_fields='acl address port max hard weight prio blacklist drain check
proxy_protocol'

# Keyword arguments.
_quillctl_ssl_options='no_sslv2 no_sslv3 no_tlsv1 no_tlsv1.1 no_tlsv1.2 cipher_server_preference'
_quillctl_protocols='ssl23 tls1.2 tls1.3'

# Sets the caller's `words` and `cword` from COMP_WORDS and COMP_CWORD, with the pieces
# that COMP_WORDBREAKS cut at ':' or '=' glued back as the shell passes them: for quill,
# `localhost:8000` is one argument, not three words.
_quillctl_reassemble() {
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
_quillctl_trim() {
    local breaks=${COMP_WORDBREAKS//[^:=]/} prefix k
    [[ -n $breaks && $1 == *["$breaks"]* ]] || return 0
    prefix=${1%"${1##*["$breaks"]}"}
    for k in "${!COMPREPLY[@]}"; do
        COMPREPLY[k]=${COMPREPLY[k]#"$prefix"}
    done
}

# Appends to COMPREPLY the lines compgen prints (one a line, so names with spaces survive).
_quillctl_compgen() {
    local line
    while IFS= read -r line; do
        COMPREPLY+=("$line")
    done < <(compgen "$@")
}

_quillctl_files() {
    compopt -o filenames 2>/dev/null
    _quillctl_compgen -f -- "$1"
}

_quillctl_dirs() {
    compopt -o filenames 2>/dev/null
    _quillctl_compgen -d -- "$1"
}

# The control address: a Unix socket path, or a [host:]port (nothing to offer).
_quillctl_address() {
    local cur=$1
    if [[ $cur == -* ]]; then
        _quillctl_compgen -W '--help' -- "$cur"
        return
    fi
    if [[ -z $cur ]]; then
        local sock
        for sock in $_quillctl_sockets_glob; do
            [[ -S $sock ]] && COMPREPLY+=("$sock")
        done
        ((${#COMPREPLY[@]})) && return
    fi
    # A port or host:port is the user's own; anything else may be a path.
    if [[ $cur == */* || ! $cur =~ ^[0-9]+$ && $cur != *:* ]]; then
        _quillctl_files "$cur"
    fi
}

# `server N field value ...`: words $2.. of the command, the cursor's word $1.
_quillctl_server() {
    local cur=$1
    shift
    # What the word at the cursor is: a field name, or the value of one.
    local state=field word
    for word in "$@"; do
        # Optional values: `drain [0|1]`, `check http PATH [STATUS]`.
        if [[ $state == drain && $word == [01] || $state == status && $word =~ ^[0-9]+$ ]]; then
            state=field
            continue
        fi
        case $state in
        field | drain | status)
            case $word in
            drain) state=drain ;;
            check) state=check ;;
            proxy_protocol) state=proxy ;;
            *) state=value ;;
            esac
            ;;
        check) [[ $word == http ]] && state=path || state=field ;;
        path) state=status ;;
        *) state=field ;;
        esac
    done
    case $state in
    field | status) _quillctl_compgen -W "$_quillctl_server_fields" -- "$cur" ;;
    drain) _quillctl_compgen -W "0 1 $_quillctl_server_fields" -- "$cur" ;;
    check) _quillctl_compgen -W 'tcp http off default' -- "$cur" ;;
    proxy) _quillctl_compgen -W 'v1 v2 off global' -- "$cur" ;;
    esac
}

# Fills COMPREPLY for the word words[cword], $1.
_quillctl_complete() {
    local cur=$1
    if ((cword == 1)); then
        _quillctl_address "$cur"
        return
    fi
    [[ ${words[1]} == --help ]] && return
    if ((cword == 2)); then
        _quillctl_compgen -W "$_quillctl_settings $_quillctl_operations no" -- "$cur"
        return
    fi
    # The command and the number of the argument at the cursor (1 = the first).
    local command=${words[2]} n=$((cword - 2))
    if [[ $command == no ]]; then
        case $n,${words[3]} in
        1,*) _quillctl_compgen -W "$_quillctl_negatable" -- "$cur" ;;
        2,ssl_option) _quillctl_compgen -W "$_quillctl_ssl_options" -- "$cur" ;;
        esac
        return
    fi
    case $n,$command in
    1,status) _quillctl_compgen -W 'html json' -- "$cur" ;;
    1,tcp_fastclose) _quillctl_compgen -W 'up down both off' -- "$cur" ;;
    1,dsr_path) _quillctl_compgen -W 'auto xdp packet' -- "$cur" ;;
    1,defer_accept) _quillctl_compgen -W 'auto' -- "$cur" ;;
    1,ssl_protocol) _quillctl_compgen -W "$_quillctl_protocols" -- "$cur" ;;
    1,ssl_option) _quillctl_compgen -W "$_quillctl_ssl_options" -- "$cur" ;;
    1,proxy_protocol) _quillctl_compgen -W 'v1 v2' -- "$cur" ;;
    1,check) _quillctl_compgen -W 'tcp http' -- "$cur" ;;
    2,acl) _quillctl_compgen -W 'permit deny' -- "$cur" ;;
    3,acl) _quillctl_compgen -W 'country' -- "$cur" ;;
    [2-9],hsts | 1[0-9],hsts) _quillctl_compgen -W 'include_subdomains preload' -- "$cur" ;;
    1,include | 1,write | 1,log | 1,web_stats | 1,geoip_db | 1,ssl_cert | 1,ssl_key | 1,ssl_ca | \
        1,ssl_ocsp_response | 1,upstream_ca)
        _quillctl_files "$cur"
        ;;
    1,ssl_ca_dir | 1,ssl_sni_path) _quillctl_dirs "$cur" ;;
    1,server) ;;
    *,server) _quillctl_server "$cur" "${words[@]:4:cword-4}" ;;
    esac
    return
}

_quillctl() {
    COMPREPLY=()
    local -a words
    local cword
    _quillctl_reassemble
    _quillctl_complete "${words[cword]}"
    _quillctl_trim "${words[cword]}"
    return 0
}

complete -F _quillctl quillctl
