// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * quill's DSR fast path (dsr_path xdp): an XDP program on the DSR interface that forwards
 * the frames of the service to their backend in the driver's receive path, exactly as the
 * AF_PACKET plane (crates/quill/src/dsr/plane.rs) would: same flow key, same mixing
 * function, same Maglev table (filled by quill from dsr::maglev), only the two MAC
 * addresses rewritten, the frame sent back out (XDP_TX). Everything else (ARP, the
 * tarpit, fragments, other addresses and ports, frames while no backend is up) is passed
 * on (XDP_PASS) to the kernel and to quill's packet socket, which handles it as before.
 *
 * Built by crates/quill/src/dsr/xdp/build (clang -target bpf); the object is committed
 * beside this file and CI checks that it is what this source builds to.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* dsr::maglev::TABLE_SIZE (prime). */
#define MAGLEV_SIZE 65537
/* command::MAX_SERVERS. */
#define MAX_SERVERS 1024
/* Established flows remembered (LRU: the least recently seen goes first). */
#define MAX_FLOWS 262144

/* What quill tells the program; one entry, key 0. */
struct config {
	__u32 vip;         /* network order */
	__u16 port;        /* network order */
	__u8 proto;        /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 roundrobin;   /* 1: the flow key is address and port, 0: address only */
	__u8 our_mac[6];
	__u16 targets;     /* backends up; 0: everything goes to user space */
};

/* A backend that is up (the map's key is its address, network order). */
struct target {
	__u8 mac[6];
	__u16 server;      /* quill's server number, for the per-server counters */
};

/* Per-server counters (per CPU; quill adds them up). */
struct server_count {
	__u64 frames;
	__u64 bytes;
	__u64 syns;        /* TCP SYNs and UDP datagrams: the connection totals */
};

enum {
	COUNT_FORWARDED = 0,
	COUNT_PASSED = 1,
	COUNT_FLOWS_NEW = 2,
	COUNT_MAX = 3,
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

/* Slot -> the address of its backend (network order). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAGLEV_SIZE);
	__type(key, __u32);
	__type(value, __u32);
} maglev SEC(".maps");

/* The backends that are up, by address. A slot or a flow naming an address that is not
 * here (a backend that left) is not followed. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct target);
} targets SEC(".maps");

/* Flow key -> the address of its backend. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_FLOWS);
	__type(key, __u64);
	__type(value, __u32);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SERVERS);
	__type(key, __u32);
	__type(value, struct server_count);
} server_counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &which);
	if (c)
		*c += 1;
}

static __always_inline int pass(void)
{
	count(COUNT_PASSED);
	return XDP_PASS;
}

/* dsr::maglev::mix64 (splitmix64's finaliser). */
static __always_inline __u64 mix64(__u64 x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static __always_inline int same_mac(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] &&
	       a[4] == b[4] && a[5] == b[5];
}

SEC("xdp")
int quill_dsr(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;

	struct config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || cfg->targets == 0)
		return pass();

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return pass();
	if (eth->h_proto != bpf_htons(ETH_P_IP) || !same_mac(eth->h_dest, cfg->our_mac))
		return pass();

	struct iphdr *iph = (void *)(eth + 1);
	if ((void *)(iph + 1) > data_end)
		return pass();
	if (iph->daddr != cfg->vip || iph->protocol != cfg->proto || iph->ihl < 5)
		return pass();
	/* Fragments carry no ports (or not all of the header): the plane places them. */
	if (iph->frag_off & bpf_htons(0x3fff))
		return pass();

	void *l4 = (void *)iph + iph->ihl * 4;
	__u16 src_port;
	__u16 dst_port;
	int syn_only = 0;
	int new_conn = 0;
	if (iph->protocol == IPPROTO_TCP) {
		struct tcphdr *th = l4;
		if ((void *)(th + 1) > data_end)
			return pass();
		src_port = th->source;
		dst_port = th->dest;
		syn_only = th->syn && !th->ack && !th->rst;
		new_conn = syn_only;
	} else {
		struct udphdr *uh = l4;
		if ((void *)(uh + 1) > data_end)
			return pass();
		src_port = uh->source;
		dst_port = uh->dest;
		new_conn = 1;
	}
	if (dst_port != cfg->port)
		return pass();

	__u64 key = bpf_ntohl(iph->saddr);
	if (cfg->roundrobin)
		key = (key << 16) | bpf_ntohs(src_port);

	struct target *t = 0;
	__u32 *pinned = bpf_map_lookup_elem(&flows, &key);
	if (pinned)
		t = bpf_map_lookup_elem(&targets, pinned);
	if (!t) {
		__u32 slot = mix64(key) % MAGLEV_SIZE;
		__u32 *ip = bpf_map_lookup_elem(&maglev, &slot);
		if (!ip)
			return pass();
		t = bpf_map_lookup_elem(&targets, ip);
		if (!t)
			return pass();
		/*
		 * A lone SYN is not remembered: a SYN flood must not push established flows
		 * out. The handshake's ACK, placed the same way, pins the flow.
		 */
		if (!syn_only) {
			__u32 chosen = *ip;
			bpf_map_update_elem(&flows, &key, &chosen, BPF_ANY);
			count(COUNT_FLOWS_NEW);
		}
	}

	__u32 server = t->server;
	struct server_count *sc = bpf_map_lookup_elem(&server_counts, &server);
	if (sc) {
		sc->frames += 1;
		sc->bytes += data_end - data;
		sc->syns += new_conn;
	}
	__builtin_memcpy(eth->h_dest, t->mac, 6);
	__builtin_memcpy(eth->h_source, cfg->our_mac, 6);
	count(COUNT_FORWARDED);
	return XDP_TX;
}

char LICENSE[] SEC("license") = "GPL";
