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
static __always_inline bool rewrite(struct __sk_buff *skb, bool v6, const struct addrs *from,
				    const struct addrs *to, __u32 way, int *verdict)
{
	struct bpf_fib_lookup fib = {};
	if (way == WAY_LOCAL) {
		if (skb->ingress_ifindex != LOOPBACK)
			return false;
	} else {
		fib.l4_protocol = IPPROTO_UDP;
		fib.sport = to->sport;
		fib.dport = to->dport;
		fib.ifindex = skb->ingress_ifindex;
		fib.tot_len = skb->len - ETH_HLEN;
		if (v6) {
			fib.family = AF_INET6;
			__builtin_memcpy(fib.ipv6_src, to->src, 16);
			__builtin_memcpy(fib.ipv6_dst, to->dst, 16);
		} else {
			fib.family = AF_INET;
			fib.ipv4_src = to->src[3];
			fib.ipv4_dst = to->dst[3];
		}
		if (bpf_fib_lookup(skb, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
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
		if (!rewrite(skb, v6, &key, &to, f->way, &verdict))
			return TC_ACT_UNSPEC;
		__sync_fetch_and_add(&f->up_packets, 1);
		__sync_fetch_and_add(&f->up_bytes, payload);
		f->last_up_ns = now;
		if (!f->awaiting_ns)
			f->awaiting_ns = now;
		return verdict;
	}
	struct reverse *r = bpf_map_lookup_elem(&reverses, &key);
	if (!r)
		return TC_ACT_UNSPEC;
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
	return verdict;
}

char LICENSE[] SEC("license") = "GPL";
