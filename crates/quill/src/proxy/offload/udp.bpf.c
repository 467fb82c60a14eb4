// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * quill's kernel path for UDP flows (udp_offload): a TC ingress program that carries the
 * datagrams of flows quill has already placed, so that neither a client's datagram nor its
 * server's answer wakes quill. quill chooses the server of every flow as always (Pen's
 * rules, in user space) and, once the flow has been answered twice, writes two entries:
 *
 *   forward: client address:port -> quill address:port  (the flow's key, as quill sees it)
 *            becomes  flow socket address:port -> server address:port
 *   reverse: server address:port -> flow socket address:port
 *            becomes  quill address:port -> client address:port
 *
 * which is exactly what quill's own relay puts on the wire (its flow socket is connected to
 * the server, and the answers leave from the address the client sent to). The socket stays
 * open in quill, so the port is not reused, and an ICMP error for it still reaches quill.
 * Anything else (other traffic, fragments, IPv4 options, IPv6 extension headers,
 * aggregated skbs, destinations the FIB cannot resolve) is passed on untouched and reaches
 * quill's sockets as before. IPv4 and IPv6 flows alike; a flow never changes family.
 *
 * The forward entry keeps the flow's counters; quill reads them on the flow's timer to
 * expire idle flows, notice unanswered datagrams and count bytes.
 *
 * Placement (quill writes `placement` only where its rules allow it: round robin,
 * `udp_responses N`, nothing that must see each flow): a datagram to one of quill's
 * listeners from a client with no entry is placed here. A slot of `slots` (servers in use,
 * each as often as its weight) names a server; one of the ports quill holds for it
 * (sockets bound and connected to the server, never used otherwise) is claimed by
 * inserting its reverse entry (BPF_NOEXIST: a port carries one flow at a time); then the
 * forward entry follows and the datagram is carried. Each datagram owes N answers; the
 * answer that pays the last removes both entries, and the port is free again. A flow that
 * is not answered keeps its port until quill sweeps it. No free port after a few tries,
 * or no slot: the datagram goes to quill, which places it itself.
 *
 * Built by crates/quill/src/proxy/offload/build (clang -target bpf); the object is committed
 * beside this file and CI checks that it is what this source builds to.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <stdbool.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define MAX_FLOWS 65536
#define AF_INET 2
#define AF_INET6 10

/* Addresses and ports in network order, as in the headers; an IPv4 address is written as
 * its IPv4-mapped IPv6 address (::ffff:a.b.c.d), so one map holds both families. */
struct addrs {
	__u32 src[4];
	__u32 dst[4];
	__u16 sport;
	__u16 dport;
};

/* How a rewritten datagram goes on. */
enum way {
	/* Its new destination is one of our addresses: up the stack (from loopback only). */
	WAY_LOCAL = 1,
	/* Elsewhere: out of the interface the FIB names (where forwarding is enabled). */
	WAY_ROUTE = 2,
};

struct forward {
	struct addrs to;           /* the rewritten addresses */
	__u32 way;                 /* enum way, as quill found it */
	__u64 up_packets;
	__u64 up_bytes;            /* UDP payload bytes, as quill counts them */
	__u64 down_packets;
	__u64 down_bytes;
	__u64 last_up_ns;          /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
	__u64 last_down_ns;
	__u64 awaiting_ns;         /* the first datagram since the last answer; 0: none */
	/* A flow the program placed itself; 0 for the flows quill hands over. */
	__u32 placed;
	__u32 server;              /* its server's index in `holds` */
	__s32 owed;                /* answers still owed; at 0 the flow ends */
	__u32 responses;           /* answers owed per datagram */
};

/* What quill wrote for placement; slots 0: the program places nothing. */
struct placement {
	__u32 slots;               /* how many of `slots` are in use */
	__u32 responses;           /* udp_responses */
};

#define MAX_SERVERS 256
#define MAX_SLOTS 1024
#define PORTS 64                  /* held ports per server; a power of two */
#define CLAIM_TRIES 4
/* `owed` of a placed flow being removed: negative whatever is added to it after. */
#define ENDING (-0x40000000)

/* A server and the ports quill holds for it. */
struct held {
	__u32 server[4];           /* its address, IPv4-mapped for IPv4 */
	__u32 socket[4];           /* the held sockets' address */
	__u16 server_port;         /* network order, as the ports below */
	__u16 ports;               /* how many of `port` are held (at most PORTS) */
	__u32 way;                 /* enum way to the server */
	__u16 port[PORTS];
};

/* Per server, per CPU: what the program placed and carried of its own flows. */
struct placed {
	__u64 flows;
	__u64 up_packets;
	__u64 up_bytes;
	__u64 down_packets;
	__u64 down_bytes;
	__u64 last_down_ns;
};

/* A listener: its address (all zero for a wildcard) and port, network order. */
struct listener {
	__u32 ip[4];
	__u16 port;
	__u16 pad;
};

struct reverse {
	struct addrs to;           /* the rewritten addresses */
	struct addrs flow;         /* the forward entry's key */
	__u32 way;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FLOWS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct addrs);
	__type(value, struct forward);
} forwards SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FLOWS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct addrs);
	__type(value, struct reverse);
} reverses SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct placement);
} placement SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct held);
} holds SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct placed);
} placed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, struct listener);
	__type(value, __u32);
} listeners SEC(".maps");

#define IP_CSUM (ETH_HLEN + __builtin_offsetof(struct iphdr, check))
#define IP_SRC (ETH_HLEN + __builtin_offsetof(struct iphdr, saddr))
#define IP6_SRC (ETH_HLEN + __builtin_offsetof(struct ipv6hdr, saddr))
#define UDP4 (ETH_HLEN + sizeof(struct iphdr))
#define UDP6 (ETH_HLEN + sizeof(struct ipv6hdr))
#define UDP_CSUM __builtin_offsetof(struct udphdr, check)

/* The loopback interface's index in every network namespace (LOOPBACK_IFINDEX). */
#define LOOPBACK 1

/* Rewrites the addresses and ports (checksums kept right, whether the skb carries a full,
 * a partial or no UDP checksum) and says in *verdict how the datagram goes on; false
 * (nothing changed) where the program cannot carry it: it then goes to quill's sockets,
 * which relay it themselves.
 *
 * A local destination is reached from the loopback interface only: there the skb keeps
 * the local route it was sent with, while a datagram from another interface with one of
 * our addresses as its source would be dropped as a martian. Another destination leaves
 * through the interface the FIB names, its neighbour resolved by the kernel; the lookup
 * needs forwarding enabled on the interface the datagram came in on. */
/* Asks the FIB how a datagram with the addresses and ports of `to` that came in on
 * interface `from_if` leaves; fills *fib (its ifindex: the way out). */
static __always_inline bool route(struct __sk_buff *skb, bool v6, const struct addrs *to,
				  __u32 from_if, struct bpf_fib_lookup *fib)
{
	fib->l4_protocol = IPPROTO_UDP;
	fib->sport = to->sport;
	fib->dport = to->dport;
	fib->ifindex = from_if;
	fib->tot_len = skb->len - ETH_HLEN;
	if (v6) {
		fib->family = AF_INET6;
		__builtin_memcpy(fib->ipv6_src, to->src, 16);
		__builtin_memcpy(fib->ipv6_dst, to->dst, 16);
	} else {
		fib->family = AF_INET;
		fib->ipv4_src = to->src[3];
		fib->ipv4_dst = to->dst[3];
	}
	return bpf_fib_lookup(skb, fib, sizeof(*fib), 0) == BPF_FIB_LKUP_RET_SUCCESS;
}

static __always_inline bool rewrite(struct __sk_buff *skb, bool v6, const struct addrs *from,
				    const struct addrs *to, __u32 way, int *verdict)
{
	struct bpf_fib_lookup fib = {};
	if (way == WAY_LOCAL) {
		if (skb->ingress_ifindex != LOOPBACK)
			return false;
	} else if (!route(skb, v6, to, skb->ingress_ifindex, &fib)) {
		return false;
	}

	const __u32 udp = v6 ? UDP6 : UDP4;
	const __u64 l4_addr = BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(__u32);
	const __u64 l4_diff = BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0;
	const __u64 l4_port = BPF_F_MARK_MANGLED_0 | sizeof(__u16);
	if (v6) {
		/* No header checksum; the UDP checksum covers both addresses. */
		__s64 diff = bpf_csum_diff((__be32 *)from->src, 32, (__be32 *)to->src, 32, 0);
		if (diff < 0)
			return false;
		bpf_l4_csum_replace(skb, udp + UDP_CSUM, 0, diff, l4_diff);
	} else {
		if (from->src[3] != to->src[3]) {
			bpf_l4_csum_replace(skb, udp + UDP_CSUM, from->src[3], to->src[3], l4_addr);
			bpf_l3_csum_replace(skb, IP_CSUM, from->src[3], to->src[3], sizeof(__u32));
		}
		if (from->dst[3] != to->dst[3]) {
			bpf_l4_csum_replace(skb, udp + UDP_CSUM, from->dst[3], to->dst[3], l4_addr);
			bpf_l3_csum_replace(skb, IP_CSUM, from->dst[3], to->dst[3], sizeof(__u32));
		}
	}
	if (from->sport != to->sport)
		bpf_l4_csum_replace(skb, udp + UDP_CSUM, from->sport, to->sport, l4_port);
	if (from->dport != to->dport)
		bpf_l4_csum_replace(skb, udp + UDP_CSUM, from->dport, to->dport, l4_port);
	/* The source and destination addresses are adjacent in both headers, as are the two
	 * ports. */
	__u16 ports[2] = {to->sport, to->dport};
	long stored;
	if (v6) {
		stored = bpf_skb_store_bytes(skb, IP6_SRC, to, 32, 0);
	} else {
		__u32 ips[2] = {to->src[3], to->dst[3]};
		stored = bpf_skb_store_bytes(skb, IP_SRC, ips, sizeof(ips), 0);
	}
	if (stored || bpf_skb_store_bytes(skb, udp, ports, sizeof(ports), 0))
		*verdict = TC_ACT_SHOT;
	else if (way == WAY_LOCAL)
		/* On up the stack, past any program attached after this one. */
		*verdict = TC_ACT_UNSPEC;
	else
		*verdict = bpf_redirect_neigh(fib.ifindex, 0, 0, 0);
	return true;
}

/* The datagram's addresses and ports and its payload length, if it is a UDP datagram the
 * program may carry: no fragment, no IPv4 options, no IPv6 extension header. */
static __always_inline bool parse(struct __sk_buff *skb, bool *v6, struct addrs *key,
				  __u64 *payload)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct udphdr *udp;
	if (skb->gso_segs > 1)
		return false;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data + ETH_HLEN;
		udp = data + UDP4;
		if ((void *)(udp + 1) > end)
			return false;
		if (ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
		    (ip->frag_off & bpf_htons(0x3fff)))
			return false;
		key->src[2] = key->dst[2] = bpf_htonl(0xffff);
		key->src[3] = ip->saddr;
		key->dst[3] = ip->daddr;
		*v6 = false;
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip = data + ETH_HLEN;
		udp = data + UDP6;
		if ((void *)(udp + 1) > end)
			return false;
		if (ip->version != 6 || ip->nexthdr != IPPROTO_UDP)
			return false;
		__builtin_memcpy(key->src, &ip->saddr, 16);
		__builtin_memcpy(key->dst, &ip->daddr, 16);
		*v6 = true;
	} else {
		return false;
	}
	key->sport = udp->source;
	key->dport = udp->dest;
	*payload = bpf_ntohs(udp->len) - sizeof(*udp);
	return true;
}

/* Whether the datagram is addressed to one of quill's listeners. */
static __always_inline bool to_listener(const struct addrs *key)
{
	struct listener l = {};
	__builtin_memcpy(l.ip, key->dst, 16);
	l.port = key->dport;
	if (bpf_map_lookup_elem(&listeners, &l))
		return true;
	/* A wildcard: 0.0.0.0 (IPv4-mapped) for IPv4 clients, then :: for both. */
	__builtin_memset(l.ip, 0, 16);
	if (key->dst[2] == bpf_htonl(0xffff) && !key->dst[0] && !key->dst[1]) {
		l.ip[2] = bpf_htonl(0xffff);
		if (bpf_map_lookup_elem(&listeners, &l))
			return true;
		l.ip[2] = 0;
	}
	return bpf_map_lookup_elem(&listeners, &l) != NULL;
}

/* Places a new flow (see the top of this file): true when the datagram was carried
 * (*verdict says how), false when it goes to quill. */
static __always_inline bool place(struct __sk_buff *skb, bool v6, const struct addrs *key,
				  __u64 payload, __u64 now, int *verdict)
{
	__u32 zero = 0;
	struct placement *p = bpf_map_lookup_elem(&placement, &zero);
	if (!p || !p->slots || p->slots > MAX_SLOTS || !to_listener(key))
		return false;
	__u32 slot = bpf_get_prandom_u32() % p->slots;
	__u32 *server = bpf_map_lookup_elem(&slots, &slot);
	if (!server)
		return false;
	__u32 index = *server;
	struct held *h = bpf_map_lookup_elem(&holds, &index);
	if (!h || !h->ports || h->ports > PORTS)
		return false;
	/* No translation between families: an IPv4 client, an IPv4 server. */
	bool server_v4 = !h->server[0] && !h->server[1] && h->server[2] == bpf_htonl(0xffff);
	if (server_v4 == v6)
		return false;

	struct reverse r = {};
	__builtin_memcpy(r.to.src, key->dst, 16);
	__builtin_memcpy(r.to.dst, key->src, 16);
	r.to.sport = key->dport;
	r.to.dport = key->sport;
	r.flow = *key;
	r.way = skb->ingress_ifindex == LOOPBACK ? WAY_LOCAL : WAY_ROUTE;
	/* The answers must find their way back here too, or they would reach a held socket
	 * and be lost (quill relays what it places itself whatever the route). They come in
	 * on loopback from a local server: a local client only. From a remote server they
	 * come in where the queries leave: a remote client, routable from there. */
	if (h->way == WAY_LOCAL) {
		if (r.way != WAY_LOCAL)
			return false;
	} else {
		struct bpf_fib_lookup fib = {};
		struct addrs out = {};
		__builtin_memcpy(out.src, h->socket, 16);
		__builtin_memcpy(out.dst, h->server, 16);
		out.sport = h->port[0];
		out.dport = h->server_port;
		if (r.way != WAY_ROUTE || !route(skb, v6, &out, skb->ingress_ifindex, &fib))
			return false;
		__u32 answers_in = fib.ifindex;
		struct bpf_fib_lookup back = {};
		if (!route(skb, v6, &r.to, answers_in, &back))
			return false;
	}
	struct addrs claim = {};
	__builtin_memcpy(claim.src, h->server, 16);
	__builtin_memcpy(claim.dst, h->socket, 16);
	claim.sport = h->server_port;
	__u32 first = bpf_get_prandom_u32();
	bool claimed = false;
	for (int i = 0; i < CLAIM_TRIES; i++) {
		__u32 at = ((first + i) % h->ports) & (PORTS - 1);
		claim.dport = h->port[at];
		if (!bpf_map_update_elem(&reverses, &claim, &r, BPF_NOEXIST)) {
			claimed = true;
			break;
		}
	}
	if (!claimed)
		return false;

	struct forward f = {};
	__builtin_memcpy(f.to.src, h->socket, 16);
	__builtin_memcpy(f.to.dst, h->server, 16);
	f.to.sport = claim.dport;
	f.to.dport = h->server_port;
	f.way = h->way;
	f.up_packets = 1;
	f.up_bytes = payload;
	f.last_up_ns = now;
	f.awaiting_ns = now;
	f.placed = 1;
	f.server = index;
	f.owed = p->responses;
	f.responses = p->responses;
	if (bpf_map_update_elem(&forwards, key, &f, BPF_NOEXIST)) {
		bpf_map_delete_elem(&reverses, &claim);
		return false;
	}
	struct addrs to = f.to;
	if (!rewrite(skb, v6, key, &to, f.way, verdict)) {
		bpf_map_delete_elem(&forwards, key);
		bpf_map_delete_elem(&reverses, &claim);
		return false;
	}
	struct placed *c = bpf_map_lookup_elem(&placed, &index);
	if (c) {
		c->flows++;
		c->up_packets++;
		c->up_bytes += payload;
	}
	return true;
}

/* Datagrams that are not the program's go on as they came (TC_ACT_UNSPEC: with TCX, to
 * the next program attached, if any, then to the stack). */
SEC("classifier")
int quill_udp(struct __sk_buff *skb)
{
	struct addrs key = {};
	bool v6;
	__u64 payload;
	if (!parse(skb, &v6, &key, &payload))
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_ns();

	struct forward *f = bpf_map_lookup_elem(&forwards, &key);
	if (f) {
		struct addrs to = f->to;
		int verdict;
		/* A placed flow owes this datagram's answers from now; one its last answer
		 * is ending goes to quill instead (its way back is being removed). */
		if (f->placed && __sync_fetch_and_add(&f->owed, f->responses) < 0)
			return TC_ACT_UNSPEC;
		if (!rewrite(skb, v6, &key, &to, f->way, &verdict))
			return TC_ACT_UNSPEC;
		__sync_fetch_and_add(&f->up_packets, 1);
		__sync_fetch_and_add(&f->up_bytes, payload);
		f->last_up_ns = now;
		if (!f->awaiting_ns)
			f->awaiting_ns = now;
		if (f->placed) {
			__u32 index = f->server;
			struct placed *c = bpf_map_lookup_elem(&placed, &index);
			if (c) {
				c->up_packets++;
				c->up_bytes += payload;
			}
		}
		return verdict;
	}
	struct reverse *r = bpf_map_lookup_elem(&reverses, &key);
	if (!r) {
		int verdict;
		if (place(skb, v6, &key, payload, now, &verdict))
			return verdict;
		return TC_ACT_UNSPEC;
	}
	struct addrs flow = r->flow;
	f = bpf_map_lookup_elem(&forwards, &flow);
	if (!f)
		return TC_ACT_UNSPEC;
	struct addrs to = r->to;
	int verdict;
	if (!rewrite(skb, v6, &key, &to, r->way, &verdict))
		return TC_ACT_UNSPEC;
	__sync_fetch_and_add(&f->down_packets, 1);
	__sync_fetch_and_add(&f->down_bytes, payload);
	f->last_down_ns = now;
	f->awaiting_ns = 0;
	if (f->placed) {
		__u32 index = f->server;
		struct placed *c = bpf_map_lookup_elem(&placed, &index);
		if (c) {
			c->down_packets++;
			c->down_bytes += payload;
			c->last_down_ns = now;
		}
		/* The answer that pays the last one owed ends the flow (forward entry first),
		 * unless a datagram came meanwhile: `owed` is marked ENDING only while 0. */
		if (__sync_fetch_and_add(&f->owed, -1) == 1 &&
		    __sync_val_compare_and_swap(&f->owed, 0, ENDING) == 0) {
			bpf_map_delete_elem(&forwards, &flow);
			bpf_map_delete_elem(&reverses, &key);
		}
	}
	return verdict;
}

char LICENSE[] SEC("license") = "GPL";
