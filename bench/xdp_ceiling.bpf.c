// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * The ceiling of an XDP forwarder on bench/dsr's topology: sends every IPv4 frame back out
 * to one fixed backend MAC address (BACKEND_MAC, given at build time) and does nothing
 * else: no lookup, no map, no counter. Whatever quill's XDP program does beyond this is
 * its cost. `xdp_pass` is for the veth peer: native XDP_TX on a veth delivers frames only
 * when the peer runs an XDP program too.
 * Built by bench/dsr_bench.py: clang -O2 -target bpf -DBACKEND_MAC=0x02,... -c
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

SEC("xdp")
int ceiling(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	const unsigned char backend[6] = { BACKEND_MAC };

	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	__builtin_memcpy(eth->h_source, eth->h_dest, 6);
	__builtin_memcpy(eth->h_dest, backend, 6);
	return XDP_TX;
}

SEC("xdp_pass")
int pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "GPL";
